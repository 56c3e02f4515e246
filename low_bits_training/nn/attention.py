"""Dot-product attention whose two products and their four backward GEMMs follow the precision plan.

``O = softmax(Q K^T * scale + mask) V`` runs two GEMMs forward and four backward. Each product is a linear
layer ``y = x W^T`` in disguise, so each gets a ``LinearPlan`` with the six roles of ``nn.roles``
unchanged (per batch and head; Q, K, V: (L, H), (S, H), (S, H); P: (L, S)):

======= ======================= =========================== ==============================
product GEMM                    operands (role)             contraction dim
======= ======================= =========================== ==============================
qk      forward  S  = Q K^T     Q (input), K (weight)       head_dim H
qk      dgrad    dQ = dS K      dS (grad_output), K         key positions S
qk      wgrad    dK = dS^T Q    dS (grad_output), Q (input) query positions L
pv      forward  O  = P V       P (input), V^T (weight)     key positions S
pv      dgrad    dP = dO V^T    dO (grad_output), V^T       head_dim H
pv      wgrad    dV = dO^T P    dO (grad_output), P (input) query positions L (dV^T = dO^T P)
======= ======================= =========================== ==============================

Scales run along each GEMM's contraction dim, as for a linear layer; a "tensor" scale covers the whole
operand (every batch and head, as Transformer Engine's fp8 attention scales Q, K, V, P, dO, dP). ``dS`` is
the gradient of ``Q K^T`` (softmax backward times ``scale``); softmax and its backward run in fp32
(``dS = P * (dP - rowsum(dP * P))``), as does every GEMM (emulation: cast operands, fp32 matmul).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import nn

from low_bits_training.formats import QuantSpec

from . import probe
from .gemm import GEMM_OPERANDS, GemmState, cast_operand, source_operand
from .probe import NO_STATE, LayerState, ProbeMode
from .roles import GEMMS, ROLES, LinearPlan, Role
from .state import QuantState

PRODUCTS: tuple[str, ...] = ("qk", "pv")
"""The plan's names of the two products (``<attention fqn>.qk`` / ``.pv``)."""


def batched_axis(role: Role) -> int:
    """A role's contraction dim in a batched (..., rows, cols) operand: -1 (cols) or -2 (rows)."""
    return -1 if role.axis == -1 else -2


def batched_spec(spec: QuantSpec | None, role: Role) -> QuantSpec | None:
    """``spec`` with an axis / block axis that counts from the end (batched operands; no-op otherwise)."""
    if spec is None or spec.scaling not in ("axis", "block"):
        return spec
    return dataclasses.replace(spec, axis=batched_axis(role))


@dataclass(frozen=True)
class AttentionPlan:
    """How one attention module casts the operands of its six GEMMs: a ``LinearPlan`` per product."""

    qk: LinearPlan = field(default_factory=LinearPlan)
    """``S = Q K^T``: input Q, weight K, grad_output dS (see the module table)."""
    pv: LinearPlan = field(default_factory=LinearPlan)
    """``O = P V``: input P, weight V^T, grad_output dO."""
    batched: tuple[tuple[QuantSpec | None, ...], ...] = field(init=False, repr=False, compare=False)
    """Per product, its specs with the axis counted from the end (``batched_spec``)."""

    def __post_init__(self) -> None:
        for name in PRODUCTS:
            if any(b != "emulate" for b in getattr(self, name).backends):
                raise ValueError(f"AttentionPlan.{name}: attention GEMMs run emulated only")
        specs = tuple(
            tuple(batched_spec(s, r) for s, r in zip(getattr(self, n).specs, ROLES, strict=True))
            for n in PRODUCTS
        )
        object.__setattr__(self, "batched", specs)

    @property
    def is_high_precision(self) -> bool:
        return self.qk.is_high_precision and self.pv.is_high_precision


def attention_gemm(
    gemm: str,
    tensors: dict[str, torch.Tensor],
    specs: tuple[QuantSpec | None, ...],
    state: GemmState,
    mode: ProbeMode,
    record: bool,
) -> torch.Tensor:
    """One GEMM of one product on batched operands (``nn.gemm.run_gemm``'s table, ``.mT`` for ``.t()``).

    Args:
        gemm: "forward" | "dgrad" | "wgrad".
        tensors: the product's natural operands, (..., rows, cols): input, weight, grad_output; each cast
            is added under its role name (for ``source = "forward"``).
        specs: the product's batched specs (``AttentionPlan.batched``).
        state: its key, probe and amax-history tensors.
        mode: what the probe records.
        record: delayed-scaled casts extend their history.

    Returns:
        fp32 batched product.
    """
    op = GEMM_OPERANDS[gemm]
    out = []
    for i, transpose in ((op.a, op.a_t), (op.b, op.b_t)):
        t = source_operand(i, tensors, specs[i], batched_axis(ROLES[i]))
        q = tensors[ROLES[i].name] = cast_operand(i, t, specs[i], (), state, mode, record).value(
            in_place=True
        )
        out.append(q.mT if transpose else q)
    y = out[0] @ out[1]
    probe.record_output(state, mode, GEMMS.index(gemm), y)
    return y


class QuantAttentionFunction(torch.autograd.Function):
    """``softmax(Q K^T * scale + mask) V`` with its six GEMMs cast by an ``AttentionPlan``.

    Q, K, V are saved in high precision and cast again in backward per role; the fp32 probabilities P are
    saved (as SDPA's math path keeps them), and so are forward casts a backward role reads.
    """

    @staticmethod
    def forward(ctx, q, k, v, mask, qk_key, qk_stats, qk_flags, qk_hist, pv_key, pv_stats, pv_flags, pv_hist,
                plan: AttentionPlan, scale: float, mode: ProbeMode, record: bool):  # fmt: skip
        # q (B, N, L, H), k / v (B, N, S, H), mask bool broadcasting to (B, N, L, S): True attends.
        states = (
            GemmState(qk_key, qk_stats, qk_flags, qk_hist),
            GemmState(pv_key, pv_stats, pv_flags, pv_hist),
        )
        ctx.plan, ctx.scale, ctx.mode, ctx.record, ctx.states = plan, scale, mode, record, states
        qk = {"input": q, "weight": k}
        s = attention_gemm("forward", qk, plan.batched[0], states[0], mode, record) * scale  # (B, N, L, S)
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        pv = {"input": p, "weight": v.mT}  # V^T (B, N, H, S): the pv product's "weight"
        o = attention_gemm("forward", pv, plan.batched[1], states[1], mode, record)  # (B, N, L, H)
        kept = [qk[n] for n in plan.qk.saved_casts] + [pv[n] for n in plan.pv.saved_casts]
        ctx.save_for_backward(q, k, v, p, *kept)
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, do):
        q, k, v, p, *kept = ctx.saved_tensors
        plan, states, args = ctx.plan, ctx.states, (ctx.mode, ctx.record)
        n = len(plan.qk.saved_casts)
        pv = {
            "input": p,
            "weight": v.mT,
            "grad_output": do,
            **dict(zip(plan.pv.saved_casts, kept[n:], strict=True)),
        }
        dp = attention_gemm("dgrad", pv, plan.batched[1], states[1], *args)  # (B, N, L, S)
        dv = attention_gemm("wgrad", pv, plan.batched[1], states[1], *args).mT  # (B, N, S, H)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True)) * ctx.scale  # d(Q K^T), fp32
        qk = {
            "input": q,
            "weight": k,
            "grad_output": ds,
            **dict(zip(plan.qk.saved_casts, kept[:n], strict=True)),
        }
        dq = attention_gemm("dgrad", qk, plan.batched[0], states[0], *args)
        dk = attention_gemm("wgrad", qk, plan.batched[0], states[0], *args)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), *([None] * 13)


def causal_mask(rows: int, cols: int, device=None) -> torch.Tensor:
    """(rows, cols) bool, True on and below the diagonal (SDPA's ``is_causal``)."""
    return torch.ones(rows, cols, dtype=torch.bool, device=device).tril()


def quant_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: AttentionPlan,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    states: tuple[LayerState | GemmState, LayerState | GemmState] = (NO_STATE, NO_STATE),
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` (bool mask or causal, GQA) with the plan's casts on its GEMMs.

    Args:
        q: (B, N, L, H) queries.
        k, v: (B, Nkv, S, H) keys and values; Nkv divides N (grouped-query attention when smaller).
        plan: the module's plan; an all-high-precision plan computes attention in fp32.
        mask: bool, broadcasting to (B, N, L, S), True where a query attends; None: causal.
        scale: the logit scale (default 1 / sqrt(H)).
        states: the qk and pv products' key, probe and amax-history tensors (``ProductState.state``).

    Returns:
        (B, N, L, H) in q's dtype.

    Raises:
        ValueError: an operand does not fit its spec (a block size that does not divide a dim), or the kv
            heads do not divide the query heads.
    """
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"quant_attention: {k.shape[1]} kv heads do not divide {q.shape[1]} query heads")
    if k.shape[1] != q.shape[1]:  # GQA: each kv head serves N / Nkv query heads (SDPA's enable_gqa)
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    mask = causal_mask(q.shape[-2], k.shape[-2], q.device) if mask is None else mask
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    record = torch.is_grad_enabled()  # evaluation forwards read amax histories but do not extend them
    qk, pv = (GemmState(*s) for s in states)
    return QuantAttentionFunction.apply(q, k, v, mask, *qk, *pv, plan, scale, probe.mode(), record)


class ProductState(QuantState, nn.Module):
    """The plan and the key / probe / amax-history buffers of one attention product (no parameters): a
    ``QuantState`` like ``QuantLinear``'s (key and probes non-persistent; a plan with delayed-scaled roles
    adds the persistent amax history, so checkpoints carry it)."""

    def __init__(self, plan: LinearPlan, name: str = "", device=None):
        super().__init__()
        self.on_plan = None
        """Called after the plan changes (the owning attention module rebuilds its ``AttentionPlan``)."""
        self.plan, self.lbt_target = plan, name
        self.init_state_buffers(device, name)

    @property
    def plan(self) -> LinearPlan:
        return self._plan

    @plan.setter
    def plan(self, plan: LinearPlan) -> None:
        # A phase or the autopilot sets it between steps, outside any compiled region.
        self._plan = plan
        if self.on_plan is not None:
            self.on_plan()

    def extra_repr(self) -> str:
        return self.quantized_roles()


__all__ = [
    "PRODUCTS",
    "AttentionPlan",
    "ProductState",
    "QuantAttentionFunction",
    "attention_gemm",
    "causal_mask",
    "quant_attention",
]
