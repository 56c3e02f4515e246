"""Write an fp32 weight update back into the parameter on the master-weight grid.

The parameter tensor keeps its own dtype; its values are rounded onto ``master_weights``' grid (emulation
when the parameter is fp32, real storage savings when the model is built in that dtype, e.g. bf16).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from low_bits_training.formats import QuantSpec, fake_quantize

from .codec import native_round
from .presets import NATIVE, with_rounding


def fit_to_shard(spec: QuantSpec, shape: tuple[int, ...]) -> QuantSpec:
    """``spec`` for a local shard of ``shape``: blocks that do not tile the last dim become one scale per row.

    Master weights are not stored separately, so their scale groups may follow the shard (documented).
    """
    if spec.scaling == "block" and (len(shape) == 0 or shape[-1] % spec.block_size):
        return replace(spec, scaling="axis")
    return spec


def master_spec(spec: QuantSpec, shape: tuple[int, ...], rounding: str) -> QuantSpec:
    """The master-weight format of a local shard of ``shape`` under ``master_rounding`` = ``rounding``: scale
    groups fitted to the shard, element rounding "stochastic" or "nearest" (plain, or Kahan's)."""
    return with_rounding(fit_to_shard(spec, shape), "stochastic" if rounding == "stochastic" else "nearest")


def on_grid(x: torch.Tensor, spec: QuantSpec, key: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``x`` rounded onto ``spec``'s grid with its rounding, as fp32.

    Scale groups follow ``x``'s last dim (a row chunk of whole blocks, or whole rows for "axis").
    """
    if spec.format in NATIVE and spec.scaling == "none":
        return native_round(x, spec, key).float()
    return fake_quantize(x, spec, key)


def write_master(
    w: torch.Tensor,
    w32: torch.Tensor,
    spec: QuantSpec | None,
    rounding: str,
    comp: torch.Tensor | None = None,
    key: torch.Tensor | None = None,
) -> None:
    """Store ``w32`` (fp32 updated weights) into the parameter rows ``w``.

    Args:
        w: rows of the parameter's local shard (written in place, any dtype).
        w32: the updated weights in fp32.
        spec: master-weight format from ``master_spec`` (made outside compiled code: a QuantSpec cannot be
            built inside a graph), or None for a plain cast to ``w.dtype``.
        rounding: "nearest", "stochastic" or "kahan".
        comp: for "kahan", the bf16 compensation rows (updated in place): the rounding error of the last
            write, added back before the next rounding.
        key: int64 key tensor of the random bits for "stochastic" (``optim.rng``).
    """
    if spec is None:
        w.copy_(w32)
        return
    if rounding == "kahan":
        target = w32 + comp.float()
        q = on_grid(target, spec)
        comp.copy_(target - q)
    else:
        q = on_grid(w32, spec, key)
    w.copy_(q)
