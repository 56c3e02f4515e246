"""The cast of a row-grouped operand with every whole-operand scale taken per group (MoE experts).

"Per expert group" means that every scale a ``QuantLinear`` takes over a whole operand is taken over one
expert's part of it: a tensor scale per expert, a column scale (wgrad, along the tokens) per expert and
column, the fp32 tensor scale of two-level scaling per expert. Blocks and tiles along the token dim must
not straddle two experts: the token dispatcher pads each expert's rows to ``nn.grouped.pad_multiple(plan)``
with zero rows (zeros change no amax and quantize to zero), so a grouped cast equals, bit for bit, the cast
of each expert's zero-padded rows on its own (``tests/nn/test_grouped.py`` holds it to that). Group amaxes
come from one ``scatter_reduce`` over the rows, no loop over the experts.
"""

from __future__ import annotations

import torch

from low_bits_training.formats import (
    Factored,
    QuantSpec,
    fake_quantize,
    group_amax,
    grouped_shape,
    in_scale_units,
    round_to,
    scale_from_amax,
    te_order,
)
from low_bits_training.formats.scaling import two_level_scales

from .cast import check_fits


def _reduces_rows(spec: QuantSpec) -> bool:
    # A scale taken over rows (the dim the expert groups run along) must be taken per group.
    return spec.scaling == "tensor" or spec.tensor_scale or (spec.scaling == "axis" and spec.axis % 2 == 0)


def _segment_amax(a: torch.Tensor, gid: torch.Tensor, groups: int) -> torch.Tensor:
    """amax over the rows of each group of a non-negative (R, C) tensor -> (groups + 1, C)."""
    out = torch.zeros(groups + 1, a.shape[1], dtype=a.dtype, device=a.device)
    return out.scatter_reduce(0, gid[:, None].expand_as(a), a, "amax", include_self=True)


def _row_amax(t: torch.Tensor, spec: QuantSpec, gid: torch.Tensor, groups: int) -> torch.Tensor:
    """Each row's view of its group's amax: (R, 1) for tensor / two-level scales, (R, C) for columns."""
    a = t.abs()
    if spec.scaling == "axis" and not spec.tensor_scale:  # one scale per column, per group
        return _segment_amax(a, gid, groups)[gid]
    rows = group_amax(a, (1,))  # (R, 1)
    return _segment_amax(rows, gid, groups)[gid]


def _round(t: torch.Tensor, spec: QuantSpec, key) -> torch.Tensor:
    # fake_quantize without scaling (no QuantSpec is built here: dataclass construction does not trace).
    return round_to(t, spec.elem, spec.rounding, spec.saturate, key)


def _two_level_scales(
    t: torch.Tensor, spec: QuantSpec, tamax: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Block scale, per-group tensor scale and multiplier of a two-level spec, in the grouped view of ``t``:
    ``formats.scaling.two_level_scales`` with the group's amax for the tensor's."""
    gshape, dims = grouped_shape(t.shape, spec)
    block_amax = group_amax(t.reshape(gshape), dims)
    tamax = group_amax(tamax.expand_as(t).reshape(gshape), dims)  # every block lies in one group
    return two_level_scales(block_amax, tamax, spec)


def group_cast(
    t: torch.Tensor,
    spec: QuantSpec | None,
    gid: torch.Tensor,
    groups: int,
    key: torch.Tensor | None = None,
    role: str = "operand",
) -> torch.Tensor:
    """Cast a row-grouped 2-D operand with every whole-operand scale taken per group (fp32 out).

    Args:
        t: (R, C) operand; its rows are grouped by ``gid``.
        spec: the role's spec (axis already the GEMM's contraction dim), or None for high precision.
        gid: (R,) group of every row, 0..groups (``groups``: rows that belong to no group).
        groups: number of groups.
        key: int64 key tensor for stochastic rounding (None: torch's global RNG).
        role: role name for the error message.

    Returns:
        fp32 (R, C): ``fake_quantize`` of each group on its own, stacked.

    Raises:
        ValueError: the shape does not fit the spec (a block size that does not divide a dim).
    """
    t = t.to(torch.float32)
    if spec is None:
        return t
    check_fits(t.shape, spec, role)
    if not _reduces_rows(spec):  # rows (or aligned row blocks) are quantized on their own already
        return fake_quantize(t, spec, key)
    amax = _row_amax(t, spec, gid, groups)
    if spec.tensor_scale:
        gshape, _ = grouped_shape(t.shape, spec)
        bs, ts, inv = _two_level_scales(t, spec, amax)
        q = _round(in_scale_units(t.reshape(gshape), bs * ts, spec, inv), spec, key)  # block x tensor scale
        return Factored(q * bs, ts).value(in_place=True).reshape(t.shape)  # as fake_quantize dequantizes
    # the per-group scale, broadcast to each row (or element); TE's encode-first one under scale_order "te"
    scale, _, inv = (
        te_order.one_level(amax, spec.elem.max)
        if spec.scale_order == "te"
        else (scale_from_amax(amax, spec), None, None)
    )
    return _round(in_scale_units(t, scale, spec, inv), spec, key) * scale
