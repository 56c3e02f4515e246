"""What each GEMM operand costs before its GEMM: the cast passes and the bytes they move (pure arithmetic).

A cast reads its source (bf16: 2 bytes an element, or the forward cast it is made from) and writes the
low-precision elements plus their scales. Two roles of one tensor share the read when they cast it to the
same values (``shares_cast``: one pass writes both layouts); a per-tensor amax (current tensor scaling,
NVFP4's two-level scale) costs one more read of the tensor. A role whose GEMM runs in bf16 (the GPU has no
kernel for its plan) is fake-quantized: the pass writes bf16. See docs/speed_model.md.
"""

from __future__ import annotations

from dataclasses import dataclass

from low_bits_training.formats import QuantSpec
from low_bits_training.nn.roles import FORWARD_SOURCES, ROLES, Role

HIGH_BYTES = 2.0
"""Bytes of one element of a high-precision activation, weight or gradient (bf16 mixed precision)."""
SCALE_BYTES = {"fp32": 4.0, "bf16": 2.0, "e8m0": 1.0, "ue4m3": 1.0}
"""Bytes of one stored scale, by scale format."""
ONCHIP: dict[str, str] = {"qk": "grad_output", "pv": "input"}
"""The (L, L) operand of each attention product (dS, P): a fused attention kernel keeps it on chip, so it
costs no HBM traffic, cast or read."""


@dataclass(frozen=True)
class CastCost:
    """The cast passes of one operand tensor of one target."""

    bytes: float
    """HBM bytes read and written."""
    kernels: int
    """Cast passes (each pays ``SpeedParams.kernel_overhead_us``)."""


def elem_bytes(spec: QuantSpec) -> float:
    """Storage bytes of one element of ``spec``'s format (packed: e2m1 is half a byte)."""
    return spec.elem.bits / 8


def scale_bytes(spec: QuantSpec, elems: float, contraction: int) -> float:
    """Bytes of the scales of ``elems`` elements cast by ``spec`` along a contraction dim of ``contraction``.

    Examples: mxfp8 (1x32 e8m0) stores ``elems / 32`` bytes; rowwise fp32 stores 4 bytes a row.
    """
    per = SCALE_BYTES[spec.scale_format]
    extra = 4.0 if spec.tensor_scale else 0.0
    if spec.scaling == "axis":
        return elems / contraction * per + extra
    if spec.scaling == "block":
        return elems / spec.block_size * per + extra
    if spec.scaling == "tile":
        return elems / spec.block_size**2 * per + extra
    return extra


def shares_cast(a: QuantSpec, b: QuantSpec) -> bool:
    """True when two roles of one tensor get the same values from one cast pass: equal specs whose scales do
    not run along the contraction dim (tensor, none, 2-D tiles), deterministic rounding, no RHT, read from
    the high-precision tensor. (``nn.roles.same_cast`` is the stricter rule our emulation reuses casts by.)"""
    return (
        a == b
        and a.scaling in ("tensor", "none", "tile")
        and a.rounding != "stochastic"
        and not a.rht
        and a.source == "high"
    )


def needs_amax_pass(spec: QuantSpec) -> bool:
    """A per-tensor amax computed before the cast (current tensor scaling, or NVFP4's tensor scale)."""
    current_tensor = spec.scaling == "tensor" and spec.amax_history == 0
    return current_tensor or spec.tensor_scale


def _source_bytes(role: Role, spec: QuantSpec, specs: dict[str, QuantSpec | None]) -> float:
    if spec.source == "forward":
        fwd = specs[FORWARD_SOURCES[role.name]]
        return elem_bytes(fwd) if fwd is not None else HIGH_BYTES
    return HIGH_BYTES


def tensor_cast(
    tensor: str,
    elems: float,
    specs: dict[str, QuantSpec | None],
    lowp: dict[str, bool],
    contraction: dict[str, int],
    repeats: dict[str, float],
) -> CastCost:
    """The cast passes of one operand tensor (``input``, ``weight`` or ``grad_output``) of one target.

    Args:
        tensor: the operand.
        elems: its elements (per step, all instances).
        specs: role name -> spec (None: high precision) of the target's plan.
        lowp: GEMM name -> whether it runs in a low-precision dtype (else its casts write bf16).
        contraction: GEMM name -> its contraction length (row scales: one per slice along it).
        repeats: GEMM name -> how often it runs per step (a recomputed forward casts again).

    Returns:
        Bytes moved and passes run.
    """
    roles = [(r, specs[r.name]) for r in ROLES if r.operand == tensor and specs[r.name] is not None]
    total, kernels, groups = 0.0, 0, []
    for role, spec in roles:
        times = repeats[role.gemm]
        width = elem_bytes(spec) if lowp[role.gemm] else HIGH_BYTES
        scales = scale_bytes(spec, elems, contraction[role.gemm]) if lowp[role.gemm] else 0.0
        total += times * (elems * width + scales)
        if not any(shares_cast(spec, g) for g in groups):
            groups.append(spec)
            total += times * elems * _source_bytes(role, spec, specs)
            kernels += 1
    if any(needs_amax_pass(s) for _, s in roles):
        total += elems * HIGH_BYTES
        kernels += 1
    return CastCost(total, kernels)
