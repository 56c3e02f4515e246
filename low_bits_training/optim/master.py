"""Write an fp32 weight update back into the parameter on the master-weight grid.

The parameter tensor keeps its own dtype; its values are rounded onto ``master_weights``' grid (emulation
when the parameter is fp32, real storage savings when the model is built in that dtype, e.g. bf16).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from low_bits_training.formats import QuantSpec, fake_quantize

from .presets import with_rounding


def fit_to_shard(spec: QuantSpec, shape: tuple[int, ...]) -> QuantSpec:
    """``spec`` for a local shard of ``shape``: blocks that do not tile the last dim become one scale per row.

    Master weights are not stored separately, so their scale groups may follow the shard (documented).
    """
    if spec.scaling == "block" and (len(shape) == 0 or shape[-1] % spec.block_size):
        return replace(spec, scaling="axis")
    return spec


def write_master(
    w: torch.Tensor,
    w32: torch.Tensor,
    spec: QuantSpec | None,
    rounding: str,
    comp: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> None:
    """Store ``w32`` (fp32 updated weights) into the local parameter shard ``w``.

    Args:
        w: the parameter's local shard (written in place, any dtype).
        w32: the updated weights in fp32 (may be ``w`` itself when ``w`` is fp32).
        spec: master-weight format, or None for a plain cast to ``w.dtype``.
        rounding: "nearest", "stochastic" or "kahan".
        comp: for "kahan", the local bf16 compensation buffer (updated in place): the rounding error of the
            last write, added back before the next rounding.
        generator: random source for "stochastic".
    """
    if spec is None:
        if w32 is not w:
            w.copy_(w32)
        return
    spec = fit_to_shard(spec, tuple(w.shape))
    if rounding == "kahan":
        target = w32 + comp.float()
        q = fake_quantize(target, with_rounding(spec, "nearest"))
        comp.copy_(target - q)
    else:
        q = fake_quantize(w32, with_rounding(spec, rounding), generator if rounding == "stochastic" else None)
    w.copy_(q)
