"""fake_quantize / quantize / dequantize of whole tensors under a QuantSpec."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from .codec import decode, encode, pack, unpack
from .random import RandomSource
from .rounding import round_signed_
from .scaling import GroupScales, OwnBuffer, group_scales, grouped_shape, in_scale_units
from .spec import QuantSpec


def _grouped(
    x: torch.Tensor, spec: QuantSpec, own_buffer: OwnBuffer = "columns"
) -> tuple[torch.Tensor, GroupScales]:
    gshape, dims = grouped_shape(x.shape, spec)
    xg = x.reshape(gshape).to(torch.float32)
    return xg, group_scales(xg, spec, dims, own_buffer)


def _round_scaled(xg: torch.Tensor, gs: GroupScales, spec: QuantSpec, generator) -> torch.Tensor:
    # Elements are divided by their group's dequant scale (scale > 0, so x / scale keeps x's sign; times
    # the exact inverse where there is one: the same bits), then rounded onto the element grid in place:
    # one fresh buffer, which matters for eager speed.
    if spec.scaling == "none":
        return round_signed_(xg.abs(), xg, spec.elem, spec.rounding, spec.saturate, generator)
    v = in_scale_units(xg, gs.scale, spec, gs.inverse)
    plus = (
        spec.scale_order == "te" and spec.tensor_scale
    )  # TE's NVFP4: the signs after the multiply (+0 for a 0)
    sign = v.clone() if plus else xg
    return round_signed_(v.abs_(), sign, spec.elem, spec.rounding, spec.saturate, generator)


class Factored(NamedTuple):
    """A cast split the way a scaled GEMM kernel consumes it: ``inner`` goes into the multiply, ``outer``
    scales its result.

    ``inner``: values on the element grid times every scale that varies along the grouped (blocked) dims,
    and times power-of-two scales (which commute with the GEMM's one rounding); ``outer``: the fp32 scale
    that is constant along every block: the tensor / per-row scale of "tensor" / "axis" scaling with exact
    scales (fp8 tensorwise), the tensor scale of two-level scaling (NVFP4), else None. Under a GEMM that
    contracts over the grouped dims, ``outer`` factors out of every sum.
    """

    inner: torch.Tensor
    outer: torch.Tensor | None

    def value(self, in_place: bool = False) -> torch.Tensor:
        """The cast's values, ``inner * outer`` (``in_place``: into ``inner``, for a caller that owns the
        split and reads nothing else of it). The one place a two-level value is formed: ``(q * block) *
        tensor``, the block product exact, so one rounding (``fake_quantize``, ``dequantize`` and the MoE
        experts' per-group casts all end here)."""
        if self.outer is None:
            return self.inner
        return self.inner.mul_(self.outer) if in_place else self.inner * self.outer


def has_outer_scale(spec: QuantSpec | None) -> bool:
    """True when casts under ``spec`` have an ``outer`` scale (``Factored``): a "tensor" / "axis" scale
    that is not a power of two (exact rounding, or relative to a two-level tensor scale), or a block / tile
    spec's two-level tensor scale."""
    if spec is None or spec.scaling == "none":
        return False
    if spec.scaling in ("tensor", "axis"):
        return spec.scale_rounding == "exact" or spec.tensor_scale
    return spec.tensor_scale


def split_scale(q: torch.Tensor, scale: torch.Tensor, spec: QuantSpec) -> Factored:
    """``Factored`` of grid values ``q`` under one "tensor" / "axis" scale (see ``Factored``)."""
    return Factored(q, scale) if has_outer_scale(spec) else Factored(q.mul_(scale), None)


def factored_quantize(
    x: torch.Tensor, spec: QuantSpec, generator: RandomSource = None, own_buffer: OwnBuffer = "columns"
) -> Factored:
    """``fake_quantize`` split into the part a GEMM multiplies and the part that scales its result.

    Args:
        x, spec, generator, own_buffer: as ``fake_quantize``.

    Returns:
        ``Factored`` with fp32 tensors; ``inner`` has x's shape, ``outer`` broadcasts against it.
    """
    xg, gs = _grouped(x, spec, own_buffer)
    y = _round_scaled(xg, gs, spec, generator)
    if spec.scaling in ("tensor", "axis"):
        return split_scale(y, gs.scale, spec)
    if spec.scaling != "none":
        y = y.mul_(gs.block_scale)
    return Factored(y.reshape(x.shape), gs.tensor_scale)


def fake_quantize(
    x: torch.Tensor, spec: QuantSpec, generator: RandomSource = None, own_buffer: OwnBuffer = "columns"
) -> torch.Tensor:
    """Quantize then dequantize: x's values as the low-bit format would carry them.

    Args:
        x: fp32 / bf16 / fp16 tensor; its shape must fit the spec (see ``check_divisible``).
        spec: the recipe.
        generator: random source for stochastic rounding (generator, int64 key tensor or None; see
            ``round_to``).
        own_buffer: which scales a compiled CPU cast computes into a buffer of their own (values
            unchanged; see ``scaling.group_scales``).

    Returns:
        Tensor of x's shape and dtype: round(x / scale) * scale per group (computed in fp32). Under
        two-level scaling the element is multiplied by its block scale first (exact), then by the tensor
        scale: the correctly rounded value of the format's number (``Factored.value``).

    Raises:
        ValueError: the shape does not fit the spec.
    """
    return factored_quantize(x, spec, generator, own_buffer).value(in_place=True).to(x.dtype)


@dataclass(frozen=True)
class QuantizedTensor:
    """Codes + scales of a quantized tensor.

    Attributes:
        codes: uint8, flat; two codes per byte for formats of <= 4 bits (see ``codec.pack``), one per byte
            otherwise (fp6 included).
        scales: fp32 block scales (values on the scale format's grid), grouped keepdim shape.
        tensor_scale: fp32 per-tensor scale of two-level scaling, else None.
        spec: the recipe.
        shape: original shape.
        dtype: original dtype.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    tensor_scale: torch.Tensor | None
    spec: QuantSpec
    shape: torch.Size
    dtype: torch.dtype

    def dequantize(self) -> torch.Tensor:
        return dequantize(self)


def quantize(x: torch.Tensor, spec: QuantSpec, generator: RandomSource = None) -> QuantizedTensor:
    """Quantize x to codes and scales; ``dequantize(quantize(x, s, g)) == fake_quantize(x, s, g)``.

    Args:
        x: fp32 / bf16 / fp16 tensor.
        spec: the recipe.
        generator: random source for stochastic rounding (generator, int64 key tensor or None; see
            ``round_to``).

    Returns:
        A ``QuantizedTensor``.

    Raises:
        ValueError: the shape does not fit the spec.
    """
    xg, gs = _grouped(x, spec)
    y = _round_scaled(xg, gs, spec, generator)
    codes = pack(encode(y, spec.elem), spec.elem.bits)
    return QuantizedTensor(codes, gs.block_scale, gs.tensor_scale, spec, x.shape, x.dtype)


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """Values of a ``QuantizedTensor`` in its original shape and dtype.

    Args:
        q: the quantized tensor.

    Returns:
        codes decoded times the block scale, times the tensor scale, reshaped to ``q.shape``, cast to ``q.dtype``.
    """
    gshape, _ = grouped_shape(q.shape, q.spec)
    fmt = q.spec.elem
    y = decode(unpack(q.codes, fmt.bits, q.shape.numel()), fmt).reshape(gshape)
    if q.spec.scaling != "none":
        y = y * q.scales
    return Factored(y, q.tensor_scale).value(in_place=True).reshape(q.shape).to(q.dtype)
