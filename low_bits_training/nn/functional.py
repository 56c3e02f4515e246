"""The quantized matmul: one autograd.Function whose three GEMMs follow a ``LinearPlan``.

Every GEMM is ``out = A @ B`` with both operands cast by their role's spec; the table ``GEMM_OPERANDS``
says which roles feed a GEMM and whether the natural (2-D) tensor is transposed after the cast. One
function (``run_gemm``) walks it for all three GEMMs. Per role, before the cast: the tensor it reads (the
operand, or the forward GEMM's cast of it, ``QuantSpec.source``) and a random Hadamard transform along the
contraction dim (``QuantSpec.rht``, ``formats.hadamard``); the cast itself may scale from an amax history
(delayed scaling, ``nn.delayed``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from low_bits_training.formats import QuantSpec, hadamard
from low_bits_training.formats.table import IntFormat

from . import kernels, probe, rng
from .cast import ShardGroups, cast
from .probe import NO_STATE, PROBE_OFF, LayerState, ProbeMode
from .roles import GEMMS, ROLES, LinearPlan, source_key

Shards = dict[str, ShardGroups]
"""Per operand name ("input", "weight", "grad_output"): its sharded dims under TP (empty: not sharded)."""


class GemmOperands(NamedTuple):
    """Which ``ROLES`` rows a GEMM reads, and whether each natural tensor is transposed after the cast."""

    a: int
    a_t: bool
    b: int
    b_t: bool


GEMM_OPERANDS: dict[str, GemmOperands] = {
    "forward": GemmOperands(0, False, 1, True),  # y  (M,N) = x (M,K) @ W^T (K,N)
    "dgrad": GemmOperands(2, False, 3, False),  # dx (M,K) = dy (M,N) @ W (N,K)
    "wgrad": GemmOperands(4, True, 5, False),  # dW (N,K) = dy^T (N,M) @ x (M,K)
}


class GemmState(NamedTuple):
    """``probe.LayerState`` plus the delayed-scaling amax history (``nn.delayed``): the tensors a quantized
    layer hands its matmul. Any field may be None."""

    key: torch.Tensor | None = None
    stats: torch.Tensor | None = None
    flags: torch.Tensor | None = None
    history: torch.Tensor | None = None
    """float32 (len(ROLES), N): each role's amax history, newest first (``nn.delayed.new_history``)."""


GEMM_OUTPUT = {"forward": "input", "dgrad": "input", "wgrad": "weight"}
"""The natural operand whose dtype a GEMM's result is returned in (y and dx: the input's; dW: the weight's)."""


def exact_in_bf16(spec: QuantSpec | None, dtype: torch.dtype) -> bool:
    """True when every value of an operand cast under ``spec`` (or, for ``None``, the operand itself in
    ``dtype``) is a bf16 number: an element grid of <= 8 significant bits times a power-of-two scale
    (scale_rounding floor / ceil / rceil, no fp32 tensor scale, no 4over6). Blocks whose scale lies below
    2**-124 (amax below ~2**-116) are the exception: their smallest elements would fall under bf16's
    subnormal floor; no training tensor comes near it."""
    if spec is None:
        return dtype == torch.bfloat16
    elem = spec.elem
    narrow = elem.bits <= 9 if isinstance(elem, IntFormat) else elem.mbits <= 7
    pow2 = spec.scaling == "none" or (spec.scale_rounding != "exact" and not spec.tensor_scale)
    return narrow and pow2 and spec.four_over_six == "off"


def gemm_dtype(gemm: str, tensors: dict[str, torch.Tensor], sa: QuantSpec | None, sb: QuantSpec | None):
    """The dtype an emulated GEMM multiplies in: bf16 when its result is returned in bf16 and both cast
    operands are bf16 numbers (``exact_in_bf16``), else fp32.

    The bf16 GEMM is what a low-precision kernel does: exact products of the grid values (a power-of-two
    scale commutes with them), fp32 accumulation, one rounding of the result to the output dtype. It differs
    from an fp32 GEMM of the same operands only in accumulation order, and runs 3-6x faster on CPUs with
    bf16 matrix units (AMX, AVX512-BF16).
    """
    out = tensors[GEMM_OUTPUT[gemm]].dtype
    op = GEMM_OPERANDS[gemm]
    da, db = (tensors[ROLES[i].operand].dtype for i in (op.a, op.b))
    exact = exact_in_bf16(sa, da) and exact_in_bf16(sb, db)
    return torch.bfloat16 if out == torch.bfloat16 and exact else torch.float32


def source_operand(i: int, tensors: dict[str, torch.Tensor], spec, axis: int | None = None) -> torch.Tensor:
    """The tensor role ``ROLES[i]`` casts: its operand (or the forward cast, ``source``), RHT'd if asked.

    ``axis`` is the contraction dim the RHT runs along (default: the role's, for 2-D operands; batched
    operands such as attention's pass -1 / -2, ``nn.attention``).
    """
    role = ROLES[i]
    t = tensors[source_key(role, spec)]
    axis = role.axis if axis is None else axis
    if spec is not None and spec.rht:  # along the contraction dim; the GEMM's other operand gets the same
        t = hadamard.rht(t, hadamard.sign_vector(spec.rht, spec.rht_seed), axis)
    return t


def cast_operand(i: int, t: torch.Tensor, spec, shards, state: GemmState, mode: ProbeMode, record: bool):
    """Cast one operand (role ``ROLES[i]``; stochastic rounding keyed by ``rng.role_key(state.key, i)``,
    delayed scaling from ``state.history[i]``) and record it in the layer's probe."""
    key = rng.role_key(state.key, i) if spec is not None and spec.rounding == "stochastic" else None
    history = (
        state.history[i] if state.history is not None and spec is not None and spec.amax_history else None
    )
    q = cast(t, spec, shards, key, ROLES[i].name, history, record)
    probe.record_operand(state, mode, i, t, spec, q if spec is not None else None)
    return q


def run_gemm(
    gemm: str,
    tensors: dict[str, torch.Tensor],
    plan: LinearPlan,
    shards: Shards,
    state: LayerState | GemmState = NO_STATE,
    mode: ProbeMode = PROBE_OFF,
    record: bool = False,
) -> torch.Tensor:
    """One GEMM of the layer, operands cast as the plan says.

    Args:
        gemm: "forward" | "dgrad" | "wgrad".
        tensors: natural 2-D operands by name: input (M,K), weight (N,K), grad_output (M,N); each cast this
            GEMM makes is added under its role name (``forward.weight``, ...), where a later GEMM's role
            with ``source = "forward"`` reads it.
        plan: the layer's plan.
        shards: sharded dims per operand (tensor parallelism), see ``Shards``.
        state: the layer's key, probe and amax-history tensors (``nn.probe``, ``nn.delayed``); empty: global
            RNG for SR, no probes, current scaling.
        mode: what the probe records.
        record: delayed-scaled casts push their amax into the history (training; see ``nn.delayed``).

    Returns:
        the product (forward (M,N), dgrad (M,K), wgrad (N,K)): fp32, or bf16 where ``gemm_dtype`` says.
    """
    state = GemmState(*state)
    op = GEMM_OPERANDS[gemm]
    sa, sb = plan.specs[op.a], plan.specs[op.b]
    a, b = source_operand(op.a, tensors, sa), source_operand(op.b, tensors, sb)
    ga, gb = shards.get(ROLES[op.a].operand, ()), shards.get(ROLES[op.b].operand, ())
    if plan.backend(gemm) == "real" and (sa is not None or sb is not None):
        probe.record_operand(state, mode, op.a, a, sa)
        probe.record_operand(state, mode, op.b, b, sb)
        y = kernels.scaled_mm(a, sa, op.a_t, ga, b, sb, op.b_t, gb)
    else:
        a = tensors[ROLES[op.a].name] = cast_operand(op.a, a, sa, ga, state, mode, record)
        b = tensors[ROLES[op.b].name] = cast_operand(op.b, b, sb, gb, state, mode, record)
        dt = gemm_dtype(gemm, tensors, sa, sb)
        a, b = a.to(dt), b.to(dt)
        y = (a.t() if op.a_t else a) @ (b.t() if op.b_t else b)
    probe.record_output(state, mode, GEMMS.index(gemm), y)
    return y


class QuantMatmul(torch.autograd.Function):
    """``y = x @ W^T`` with quantized forward, input-gradient and weight-gradient GEMMs.

    The layer's state tensors (key, statistics, flags, amax history) ride along as plain inputs and are kept
    on ``ctx`` (not saved tensors: the probes and delayed scaling update them in place, which would trip
    autograd's version check). Forward casts a backward role reads (``LinearPlan.saved_casts``) are saved.
    """

    @staticmethod
    def forward(
        ctx,
        x: torch.Tensor,
        w: torch.Tensor,
        key: torch.Tensor | None,
        stats: torch.Tensor | None,
        flags: torch.Tensor | None,
        history: torch.Tensor | None,
        plan: LinearPlan,
        shards: Shards,
        mode: ProbeMode,
        record: bool,
    ) -> torch.Tensor:
        # x (M, K), w (N, K); saved in high precision, cast again in backward per role.
        ctx.plan, ctx.shards, ctx.mode, ctx.record = plan, shards, mode, record
        ctx.state = GemmState(key, stats, flags, history)
        tensors = {"input": x, "weight": w}
        y = run_gemm("forward", tensors, plan, shards, ctx.state, mode, record)
        ctx.save_for_backward(x, w, *(tensors[name] for name in plan.saved_casts))
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, *kept = ctx.saved_tensors
        tensors = {"input": x, "weight": w, "grad_output": dy}  # dy (M, N)
        tensors.update(zip(ctx.plan.saved_casts, kept, strict=True))
        dx = dw = None
        args = (tensors, ctx.plan, ctx.shards, ctx.state, ctx.mode, ctx.record)
        if ctx.needs_input_grad[0]:
            dx = run_gemm("dgrad", *args).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = run_gemm("wgrad", *args).to(w.dtype)
        return dx, dw, None, None, None, None, None, None, None, None


def quant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    plan: LinearPlan,
    shards: Shards | None = None,
    state: LayerState | GemmState = NO_STATE,
) -> torch.Tensor:
    """``F.linear`` with the plan's casts on all three GEMMs (plain tensors; see ``tp.py`` for DTensors).

    Args:
        x: (..., K) input.
        weight: (N, K).
        bias: (N,) or None; added in high precision.
        plan: the layer's plan; an all-high-precision plan is exactly ``F.linear``.
        shards: sharded dims per operand when these are TP-local shards.
        state: the layer's key, probe and amax-history tensors (``nn.probe``, ``nn.delayed``); what is
            recorded follows ``probe.mode()``; amax histories grow only with grad enabled (training).

    Returns:
        (..., N) in x's dtype.

    Raises:
        ValueError: an operand's shape does not fit its spec (e.g. a block size that does not divide it).
    """
    if plan.is_high_precision:
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # (M, K)
    record = torch.is_grad_enabled()  # evaluation forwards read amax histories but do not extend them
    y = QuantMatmul.apply(x2, weight, *GemmState(*state), plan, shards or {}, probe.mode(), record)  # (M, N)
    y = y.reshape(*lead, weight.shape[0])
    return y if bias is None else y + bias
