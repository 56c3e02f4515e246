"""Casting one GEMM operand: fake-quantized values (emulate) or grid values + scales (real kernels).

Under tensor parallelism an operand is a local shard. Groups that lie inside one shard quantize the same
locally as globally; a scale that reduces over a sharded dim ("tensor", or "axis" across the shard) needs
the global amax, so its local amax is all-reduced (MAX) over that dim's process group first. The result is
then bit-identical to the unsharded computation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from low_bits_training.formats import QuantSpec, check_divisible, fake_quantize, scale_from_amax
from low_bits_training.nn import rng

ShardGroups = tuple[tuple[int, object], ...]
"""``((dim, process_group), ...)``: dims of a local 2-D operand that are sharded, and over which group."""


def reduced_dims(spec: QuantSpec, ndim: int) -> tuple[int, ...]:
    """Dims a spec's scale reduces over entirely (tensor: all; axis: the axis; block/tile: none)."""
    if spec.scaling == "tensor" or spec.tensor_scale:
        return tuple(range(ndim))
    if spec.scaling == "axis":
        return (spec.axis % ndim,)
    return ()


def needs_global_amax(spec: QuantSpec, ndim: int, shards: ShardGroups) -> bool:
    """True when the scale reduces over a sharded dim (see the module docstring).

    Raises:
        NotImplementedError: two-level (tensor_scale) or block/tile scaling with a block crossing shards.
    """
    sharded = {d for d, _ in shards}
    hit = sharded & set(reduced_dims(spec, ndim))
    if hit and (spec.tensor_scale or spec.scaling not in ("tensor", "axis")):
        raise NotImplementedError(
            f"quantize: {spec} reduces over tensor-parallel-sharded dim {min(hit)}; two-level/per-tensor "
            "scales of sharded block formats are not supported under TP (use tensor_parallel_degree=1)"
        )
    return bool(hit)


def _global_amax(t: torch.Tensor, spec: QuantSpec, shards: ShardGroups) -> torch.Tensor:
    dims = reduced_dims(spec, t.dim())
    amax = torch.amax(t.abs(), dim=dims, keepdim=True).to(torch.float32)  # (1,1) or keepdim rows
    for d, group in shards:
        if d in dims:
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def _generator(spec: QuantSpec, t: torch.Tensor) -> torch.Generator | None:
    # Stochastic rounding draws from the layers' own per-step stream (see rng.py), never the global RNG.
    return rng.generator_for(t.device) if spec.rounding == "stochastic" else None


def _unscaled(spec: QuantSpec) -> QuantSpec:
    return QuantSpec(spec.format, "none", rounding=spec.rounding, saturate=spec.saturate)


def scaled_values(
    t: torch.Tensor, spec: QuantSpec, shards: ShardGroups = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid values and dequant scales of a tensor- or axis-scaled operand: ``t ~= q * scale``.

    Bit-identical to ``fake_quantize``: the same amax -> scale, the same division, the same rounding.

    Args:
        t: 2-D operand (local shard under TP).
        spec: a "tensor" or "axis" spec.
        shards: sharded dims of ``t`` and their process groups.

    Returns:
        ``(q, scale)``: fp32 values on the element grid, fp32 scale of shape (1, 1), (M, 1) or (1, K).
    """
    amax = _global_amax(t, spec, shards)
    scale = scale_from_amax(amax, spec)
    q = fake_quantize(t.to(torch.float32) / scale, _unscaled(spec), _generator(spec, t))
    return q, scale


def cast(t: torch.Tensor, spec: QuantSpec | None, shards: ShardGroups = ()) -> torch.Tensor:
    """``t`` as the low-bit format would carry it (fp32), or ``t`` in fp32 for high precision.

    Args:
        t: 2-D operand (local shard under TP).
        spec: the role's spec (axis already set to the contraction dim), or None.
        shards: sharded dims of ``t`` and their process groups.

    Returns:
        fp32 tensor of ``t``'s shape.

    Raises:
        ValueError: the shape does not fit the spec (message names the role's dims and block size).
    """
    t = t.to(torch.float32)
    if spec is None:
        return t
    if needs_global_amax(spec, t.dim(), shards):
        q, scale = scaled_values(t, spec, shards)
        return q * scale
    check_divisible(t.shape, spec)
    return fake_quantize(t, spec, _generator(spec, t))
