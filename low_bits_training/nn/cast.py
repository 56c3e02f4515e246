"""Casting one GEMM operand: fake-quantized values (emulate) or grid values + scales (real kernels).

Under tensor parallelism an operand is a local shard. Groups that lie inside one shard quantize the same
locally as globally; a scale that reduces over a sharded dim ("tensor", or "axis" across the shard) needs
the global amax, so its local amax is all-reduced (MAX) over that dim's process group first. The result is
then bit-identical to the unsharded computation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from low_bits_training.formats import (
    Factored,
    QuantSpec,
    RandomSource,
    check_divisible,
    factored_quantize,
    in_scale_units,
    round_to,
    scale_from_amax,
    split_scale,
)

from . import delayed

ShardGroups = tuple[tuple[int, object], ...]
"""``((dim, process_group), ...)``: dims of a local 2-D operand that are sharded, and over which group."""


def reduced_dims(spec: QuantSpec, ndim: int) -> tuple[int, ...]:
    """Dims a spec's scale reduces over entirely (tensor: all; axis: the axis; block/tile: none)."""
    if spec.scaling == "tensor" or spec.tensor_scale:
        return tuple(range(ndim))
    if spec.scaling == "axis":
        return (spec.axis % ndim,)
    return ()


def needs_global_amax(spec: QuantSpec, ndim: int, shards: ShardGroups, role: str = "operand") -> bool:
    """True when the scale reduces over a sharded dim (see the module docstring).

    Raises:
        NotImplementedError: two-level (tensor_scale) or block/tile scaling with a block crossing shards.
    """
    sharded = {d for d, _ in shards}
    hit = sharded & set(reduced_dims(spec, ndim))
    if hit and (spec.tensor_scale or spec.scaling not in ("tensor", "axis")):
        raise NotImplementedError(
            f"quantize: {role} ({spec}) reduces over tensor-parallel-sharded dim {min(hit)}; two-level/per-tensor "
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


def _round(scaled: torch.Tensor, spec: QuantSpec, key: RandomSource) -> torch.Tensor:
    # ``fake_quantize`` under scaling "none" (the same rounding call), without building a QuantSpec in the
    # graph (its validation cannot be traced by torch.compile).
    return round_to(scaled, spec.elem, spec.rounding, spec.saturate, key)


def scaled_values(
    t: torch.Tensor, spec: QuantSpec, shards: ShardGroups = (), key: RandomSource = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Grid values and dequant scales of a tensor- or axis-scaled operand: ``t ~= q * scale``.

    Bit-identical to ``fake_quantize``: the same amax -> scale, the same division, the same rounding.

    Args:
        t: 2-D operand (local shard under TP).
        spec: a "tensor" or "axis" spec.
        shards: sharded dims of ``t`` and their process groups.
        key: random source of stochastic rounding (an int64 key tensor from ``nn.rng.role_key``).

    Returns:
        ``(q, scale)``: fp32 values on the element grid, fp32 scale of shape (1, 1), (M, 1) or (1, K).
    """
    amax = _global_amax(t, spec, shards)
    scale = scale_from_amax(amax, spec)
    q = _round(in_scale_units(t.to(torch.float32), scale, spec), spec, key)
    return q, scale


def delayed_values(
    t: torch.Tensor,
    spec: QuantSpec,
    shards: ShardGroups,
    key: RandomSource,
    history: torch.Tensor,
    record: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``scaled_values`` of a delayed-scaled ("tensor", ``amax_history`` > 0) operand: the scale comes from
    the role's amax history (``nn.delayed``), which this cast then extends when ``record`` is set.

    Args:
        t: 2-D operand (local shard under TP).
        spec: its spec.
        shards: sharded dims of ``t`` (the current amax is the global one).
        key: random source of stochastic rounding.
        history: the role's history row (updated in place).
        record: push this cast's amax (training); False reads the history only (evaluation).

    Returns:
        ``(q, scale)`` as ``scaled_values``.
    """
    amax = delayed.reduce_amax(_global_amax(t, spec, shards))  # (1, 1)
    scale = scale_from_amax(delayed.history_amax(history, spec, amax), spec)
    if record:
        delayed.record(history, spec, amax)
    return _round(in_scale_units(t.to(torch.float32), scale, spec), spec, key), scale


def cast_factored(
    t: torch.Tensor,
    spec: QuantSpec | None,
    shards: ShardGroups = (),
    key: RandomSource = None,
    role: str = "operand",
    history: torch.Tensor | None = None,
    record: bool = False,
) -> Factored:
    """``t`` as the low-bit format would carry it, split the way a scaled GEMM consumes it (``Factored``:
    the part the GEMM multiplies, the fp32 scale of its result); high precision: ``t`` in fp32, no scale.

    Args:
        t: 2-D operand (local shard under TP).
        spec: the role's spec (axis already set to the contraction dim), or None.
        shards: sharded dims of ``t`` and their process groups.
        key: random source of stochastic rounding (an int64 key tensor from ``nn.rng.role_key``; None:
            torch's global RNG).
        role: the operand's role name (``forward.input``, ...), for the error message.
        history: the role's amax history row when ``spec`` is delayed-scaled (``nn.delayed``); None:
            current scaling.
        record: with a history, push this cast's amax into it (see ``delayed_values``).

    Returns:
        fp32 ``Factored``; ``inner`` has ``t``'s shape.

    Raises:
        ValueError: the shape does not fit the spec (the message names the role, the shape and the block).
    """
    t = t.to(torch.float32)
    if spec is None:
        return Factored(t, None)
    check_fits(t.shape, spec, role)  # every path below groups t by the spec's blocks
    if spec.amax_history and history is not None:
        return split_scale(*delayed_values(t, spec, shards, key, history, record), spec)
    if needs_global_amax(spec, t.dim(), shards, role):
        return split_scale(*scaled_values(t, spec, shards, key), spec)
    return factored_quantize(t, spec, key, own_buffer="all")  # the grouped (MoE) casts keep "columns"


def cast(t: torch.Tensor, spec: QuantSpec | None, *args, **kwargs) -> torch.Tensor:
    """``t`` as the low-bit format would carry it (fp32), or ``t`` in fp32 for high precision: the values
    of ``cast_factored`` (the same arguments)."""
    return cast_factored(t, spec, *args, **kwargs).value(in_place=True)


def check_fits(shape: torch.Size, spec: QuantSpec, role: str) -> None:
    """``check_divisible`` with the role named in the one-line error.

    Raises:
        ValueError: ``role (shape): <why>``.
    """
    try:
        check_divisible(shape, spec)
    except ValueError as e:
        raise ValueError(f"{role} {tuple(shape)} ({spec}): {e}") from None
