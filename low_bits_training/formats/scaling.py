"""Scales: which elements share one (grouping), and how a group's amax becomes a scale.

Grouping is a reshape, never a copy: the tensor is viewed as ``grouped_shape`` and amax is taken over
``reduce_dims`` with keepdim, so the scale tensor broadcasts against the grouped view.

- tensor: shape unchanged, reduce all dims -> scale (1, ..., 1)
- axis:   shape unchanged, reduce ``axis`` -> e.g. (M, 1) for a (M, K) tensor and axis=-1
- block:  (..., N, ...) -> (..., N // bs, bs, ...) with the block dim right after ``axis`` -> (..., N//bs, 1, ...)
- tile:   (..., M, N) -> (..., M // bs, bs, N // bs, bs) -> scale (..., M//bs, 1, N//bs, 1)
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch

from . import adaptive, te_order
from .native import compiling_for_cpu
from .rounding import div_rn, exp2i, floor_log2, round_to
from .spec import QuantSpec
from .table import get_format


def _axis(ndim: int, axis: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"QuantSpec.axis={axis} is out of range for a {ndim}-D tensor")
    return axis % ndim


def check_divisible(shape: tuple[int, ...] | torch.Size, spec: QuantSpec) -> None:
    """Check that a tensor of ``shape`` can be grouped under ``spec``.

    Raises:
        ValueError: block_size does not divide the blocked dim (names block_size, the dim and its size),
            "tile" on a tensor with fewer than 2 dims, or an axis out of range.
    """
    shape = tuple(shape)
    dims: list[int] = []
    if spec.scaling in ("axis", "block"):
        a = _axis(len(shape), spec.axis)
        dims = [a] if spec.scaling == "block" else []
    elif spec.scaling == "tile":
        if len(shape) < 2:
            raise ValueError(f"QuantSpec.scaling='tile' needs a tensor with >= 2 dims, got shape {shape}")
        dims = [len(shape) - 2, len(shape) - 1]
    for d in dims:
        if shape[d] % spec.block_size:
            raise ValueError(
                f"QuantSpec.block_size={spec.block_size} does not divide dim {d} of size {shape[d]} (shape {shape})"
            )


def grouped_shape(shape: tuple[int, ...], spec: QuantSpec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The grouped view shape of a tensor and the dims a group's amax is reduced over (see module doc)."""
    shape, bs = tuple(shape), spec.block_size
    check_divisible(shape, spec)
    if spec.scaling == "none":
        return shape, ()
    if spec.scaling == "tensor":
        return shape, tuple(range(len(shape)))
    if spec.scaling == "axis":
        return shape, (_axis(len(shape), spec.axis),)
    if spec.scaling == "block":
        a = _axis(len(shape), spec.axis)
        return (*shape[:a], shape[a] // bs, bs, *shape[a + 1 :]), (a + 1,)
    m, n = shape[-2:]
    return (*shape[:-2], m // bs, bs, n // bs, bs), (len(shape) - 1, len(shape) + 1)


def group_amax(xg: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """amax of |x| over ``dims`` (keepdim), as fp32. NaN anywhere in a group gives NaN.

    Built from ``torch.aminmax`` (one read of x, no |x| temporary); further dims are reduced on the small
    partial result.
    """
    if not dims:
        return torch.ones((1,) * xg.dim(), dtype=torch.float32, device=xg.device)
    if len(dims) == xg.dim():
        mn, mx = torch.aminmax(xg)
        return torch.maximum(-mn, mx).abs_().to(torch.float32).reshape((1,) * xg.dim())
    for d in sorted(dims, reverse=True):
        mn, mx = torch.aminmax(xg, dim=d, keepdim=True)
        xg = torch.maximum(-mn, mx)
    return xg.abs_().to(torch.float32)


def _pow2_exponent(amax: torch.Tensor, spec: QuantSpec, max_elem: float, emax_elem: int) -> torch.Tensor:
    """Exponent of the power-of-two scale for scale_rounding floor / ceil / rceil (int32)."""
    if spec.scale_rounding == "rceil":  # round the fp32 quotient up to a power of two (cvt.rp.ue8m0)
        d = div_rn(amax, max_elem)
        # An fp32-subnormal quotient (< 2**-126) has no exponent field to read: scale it into the normal
        # range by 2**64 (exact) first, so ceil(log2 d) stays right down to the scale format's floor.
        tiny = d < 2.0**-126
        d = torch.where(tiny, d * 2.0**64, d)
        e = floor_log2(d) + ((d.view(torch.int32) & 0x7FFFFF) != 0).to(torch.int32)
        return e - 64 * tiny.to(torch.int32)
    e = floor_log2(amax) - emax_elem  # OCP MX v1.0 sec. 6.3: floor(log2(amax)) - emax_elem
    if spec.scale_rounding == "ceil":
        e = e + ((amax.view(torch.int32) & 0x7FFFFF) != 0).to(torch.int32)
    return e


def scale_from_amax(
    amax: torch.Tensor,
    spec: QuantSpec,
    tensor_scale: torch.Tensor | None = None,
    target: float | None = None,
    tensor_encode: torch.Tensor | None = None,
) -> torch.Tensor:
    """The dequant scale (fp32, on ``spec.scale_format``'s grid) for each group amax.

    Args:
        amax: fp32 group amax (>= 0, maybe NaN/inf).
        spec: the recipe (element format, scale_format, scale_rounding, margin).
        tensor_scale: two-level scaling: amax/max_elem is divided by this fp32 scale, then rounded (NVFP4).
        target: the element value amax maps to (default: the format's max; 4over6's other candidate: 4).
        tensor_encode: in place of tensor_scale under ``scale_order = "te"``: the encode scale (``te_order``).

    Returns:
        fp32 scales of amax's shape, never below the scale format's smallest subnormal (smallest normal
        with ``scale_min = "normal"``); amax == 0 gives 1, NaN amax gives NaN, and so does an infinite
        amax with ``inf_amax = "nan"`` (the whole group then dequantizes to NaN).
    """
    elem, sfmt = spec.elem, get_format(spec.scale_format)
    max_elem = elem.max if target is None else target
    smallest = smallest_scale(spec)
    if spec.scale_rounding == "exact":
        if tensor_encode is not None:
            s = te_order.raw_block_scale(amax, tensor_encode, max_elem, spec.scale_order)
        else:
            s = div_rn(amax, max_elem) if tensor_scale is None else div_rn(amax, max_elem) / tensor_scale
        if spec.margin:
            s = s * 2.0**spec.margin
        s = round_to(s, sfmt)
        # never a zero scale, unless an underflowing group is to be zeroed (its scale 0: see in_scale_units)
        s = (
            torch.where(s == 0, 0.0, s.clamp_min(smallest))
            if spec.scale_underflow == "zero"
            else s.clamp_min_(smallest)
        )
    else:
        rel = amax if tensor_scale is None else amax / tensor_scale
        e = _pow2_exponent(rel, spec, max_elem, elem.emax) + spec.margin
        lo, hi = int(math.log2(smallest)), sfmt.emax
        s = exp2i(e.clamp_(lo, hi))
    s = torch.where(amax == 0, torch.ones((), device=s.device), s)
    nan = torch.isnan(amax) | torch.isinf(amax) if spec.inf_amax == "nan" else torch.isnan(amax)
    return torch.where(nan, torch.full((), float("nan"), device=s.device), s)


class GroupScales(NamedTuple):
    """Per-group statistics under a spec; all fp32, keepdim, broadcastable against the grouped view."""

    amax: torch.Tensor
    """amax of |x| per group."""
    scale: torch.Tensor
    """Effective dequant scale per group (block scale * tensor scale when two-level)."""
    block_scale: torch.Tensor
    """The stored scale per group (on scale_format's grid); equals ``scale`` without a tensor scale."""
    tensor_scale: torch.Tensor | None
    """The fp32 per-tensor scale of two-level scaling, else None."""
    inverse: torch.Tensor | None = None
    """What the cast multiplies by in place of dividing by ``scale``: ``1 / scale`` where exact (power-of-two
    scales down to 2**-127: MX; the division's bits, cheaper), always under ``scale_apply = "reciprocal"``
    (TE's multiplier under ``scale_order = "te"``, ``two_level_scales`` / ``te_order.one_level``); else None."""


def tensor_scale_max(spec: QuantSpec) -> float:
    """The scale-format value a two-level tensor scale maps the tensor amax to (over the element max):
    the scale format's max, or 256 under 4over6 (room for its 1.5x larger block scales)."""
    return adaptive.TENSOR_SCALE_MAX if spec.four_over_six != "off" else get_format(spec.scale_format).max


def smallest_scale(spec: QuantSpec) -> float:
    """The smallest scale ``spec`` gives: the scale format's smallest subnormal (smallest normal with
    ``scale_min = "normal"``)."""
    sfmt = get_format(spec.scale_format)
    return sfmt.min_normal if spec.scale_min == "normal" else sfmt.min_subnormal


def two_level_scales(amax: torch.Tensor, tensor_amax: torch.Tensor, spec: QuantSpec) -> tuple:
    """``(block scale, tensor scale, inverse)`` of two-level scaling from group amaxes and the tensor amax (or
    each group's own: MoE's casts). Values dequantize with the tensor scale fl(tensor amax / (scale max x elem
    max)), 1 for a zero tensor; ``inverse`` is Transformer Engine's in ``scale_order = "te"``, else None."""
    top = tensor_scale_max(spec) * spec.elem.max
    ts = torch.where(tensor_amax == 0, 1.0, div_rn(tensor_amax, top))
    if spec.scale_order == "decode":
        return scale_from_amax(amax, spec, tensor_scale=ts), ts, None
    enc = te_order.encode_scale(tensor_amax, top)
    bs = scale_from_amax(amax, spec, tensor_encode=enc)
    return bs, ts, te_order.multiplier(bs, enc)


def _inverse_exact(spec: QuantSpec) -> bool:
    """True when every scale of ``spec`` is a power of two whose inverse fp32 holds exactly (scales from
    the smallest, >= 2**-127, to 2**127; fp32-format power-of-two scales may go down to 2**-149, whose
    inverse overflows)."""
    return spec.scale_rounding != "exact" and smallest_scale(spec) >= 2.0**-127


def in_scale_units(
    x: torch.Tensor, scale: torch.Tensor, spec: QuantSpec, inverse: torch.Tensor | None = None
) -> torch.Tensor:
    """``x`` in units of its group's ``scale``, the value that is rounded onto the element grid: ``x / scale``,
    or ``x * fl(1 / scale)`` under ``spec.scale_apply = "reciprocal"`` (the one place the two differ), or
    ``x * inverse`` where the caller has it (``GroupScales.inverse``; ``scale_order = "te"`` needs it, a
    ValueError without, and makes its zeros +0); 0 in a group zeroed for underflow (``zero_underflowed``)."""
    if inverse is not None:
        v = x * inverse
    elif spec.scale_order != "decode":
        raise ValueError(f"in_scale_units: {spec} multiplies by two_level_scales' inverse; none was passed")
    else:
        v = x * (1.0 / scale) if spec.scale_apply == "reciprocal" else x / scale
    v = zero_underflowed(v, scale, spec)
    return te_order.plus_zero(v) if spec.scale_order == "te" and spec.tensor_scale else v


def zero_underflowed(v: torch.Tensor, scale: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """``v`` (values in scale units) with the groups whose scale is 0 set to 0, under ``scale_underflow =
    "zero"`` (x / 0 would be inf or NaN); ``v`` itself otherwise."""
    return torch.where(scale == 0, 0.0, v) if spec.scale_underflow == "zero" else v


OwnBuffer = Literal["none", "columns", "all"]
"""Which scales a compiled CPU cast computes into a buffer of their own (see ``group_scales``)."""


def group_scales(
    xg: torch.Tensor, spec: QuantSpec, dims: tuple[int, ...], own_buffer: OwnBuffer = "none"
) -> GroupScales:
    """Scales of an already grouped tensor ``xg`` (see ``grouped_shape``).

    ``own_buffer``: under torch.compile on CPU, compute the scales into a buffer of their own
    (``materialize``) instead of letting inductor inline them into the cast. Inlined, inductor derives the
    scale again for every element (or vector of elements), with bit reinterpretations it runs element by
    element: 1.5-2x the cost of the whole cast. The same arithmetic, so the same values. ``"columns"``: only
    where the scale varies along the contiguous last dim (blocks or per-column scales along a leading dim,
    e.g. the weight-gradient GEMM's token-dim blocks), where the gain is largest. ``"all"``: row-block and
    tensor scales too; faster still, but in the MoE grouped GEMMs' compiled backward it trips an assertion
    in inductor's CPU loop-split pass (torch 2.14: two fused loops of equal size and different shapes), so
    the grouped path keeps ``"columns"``. For whole-tensor casts (``fake_quantize``, ``quantize``); the
    optimizer's fused chunk updates have per-row scales.
    """
    amax = group_amax(xg, dims)
    if spec.scaling == "none":
        one = torch.ones_like(amax)
        return GroupScales(amax, one, one, None)
    if spec.tensor_scale:
        bs, ts, inv = two_level_scales(amax, amax.amax(), spec)
    elif spec.scale_order == "te":  # one level: Transformer Engine's encode-first exact scales
        bs, ts, inv = te_order.one_level(amax, spec.elem.max)
    else:
        bs, ts, inv = scale_from_amax(amax, spec), None, None
    if spec.four_over_six != "off":  # 4over6: amax -> 6 or amax -> 4, the one with less error (adaptive.py)
        four = scale_from_amax(amax, spec, tensor_scale=ts, target=adaptive.TARGETS[1])
        bs = adaptive.choose(xg, (bs, four), ts, dims, spec.four_over_six, spec.scale_apply == "reciprocal")
    own = (
        own_buffer != "none"
        and compiling_for_cpu(xg.device)
        and (own_buffer == "all" or xg.dim() - 1 not in dims)
    )
    if inv is None and spec.scale_apply == "reciprocal":  # fl(1 / (block x tensor scale)), as it multiplies
        inv = 1.0 / (bs if ts is None else bs * ts)
    elif inv is None and ts is None and _inverse_exact(spec):  # exact: the division's bits, and cheaper
        inv = 1.0 / bs
    if own:
        bs, inv = materialize(bs), None if inv is None else materialize(inv)
    return GroupScales(amax, bs if ts is None else bs * ts, bs, ts, inv)


@torch.library.custom_op("lbt::materialize", mutates_args=())
def materialize(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` that torch.compile computes into a buffer of its own (an opaque op: inductor cannot
    inline what produced ``x`` into the kernels that read the copy)."""
    return x.clone()


@materialize.register_fake
def _materialize_shape(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def compute_scales(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The dequant scale per group of x under spec (fp32).

    Args:
        x: the tensor to be quantized.
        spec: the recipe.

    Returns:
        fp32 scales shaped like the grouped view with the group dims kept as 1 (see ``grouped_shape``):
        ``x.view(grouped_shape(x.shape, spec)[0]) / scales`` is what gets rounded.

    Raises:
        ValueError: the shape does not fit the spec (see ``check_divisible``).
    """
    gshape, dims = grouped_shape(x.shape, spec)
    return group_scales(x.reshape(gshape), spec, dims).scale
