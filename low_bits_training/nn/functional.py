"""The quantized matmul: one autograd.Function whose three GEMMs (``nn.gemm.run_gemm``) follow a ``LinearPlan``.

The forward runs the forward GEMM and keeps what the backward needs: the high-precision operands, the casts a
backward role reads (``LinearPlan.saved_casts``) and those it reuses, each in the narrowest dtype that holds it
exactly (``stored``); the backward runs dgrad and wgrad from them, reading W through an opaque copy where a
compiled backward would otherwise keep a merged fp32 copy of it (``backward_weight``). ``quant_linear`` is the
functional form over (..., K) inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from low_bits_training.formats import Factored, QuantSpec
from low_bits_training.formats.native import native_fp8_dtype
from low_bits_training.formats.scaling import materialize

from . import delayed, probe
from .gemm import Deferred, GemmState, Kept, Shards, exact_in_bf16, run_gemm
from .probe import NO_STATE, LayerState, ProbeMode
from .roles import ROLE_NAMES, ROLES, LinearPlan


def stored(kept: Kept, spec: QuantSpec, device: torch.device) -> tuple[torch.Tensor, ...]:
    """A forward cast as the backward keeps it (``QuantMatmul``): its GEMM part in the narrowest dtype that
    holds it exactly (the format's torch fp8 dtype for bare grid values; else bf16 where the values are
    bf16 numbers, ``exact_in_bf16``; else fp32), then its outer scale, non-finite flag and recorded amax
    (empty tensors for None): ``STORED`` tensors."""
    f = kept.cast
    fp8 = native_fp8_dtype(spec.elem, device) if f.outer is not None or spec.scaling == "none" else None
    dtype = fp8 or (torch.bfloat16 if exact_in_bf16(spec, torch.float32) else torch.float32)
    empty = f.inner.new_empty(0)
    return (f.inner.to(dtype), *(empty if t is None else t for t in (f.outer, kept.bad, kept.amax)))


STORED = 4
"""Tensors ``stored`` gives per cast."""


def restored(inner: torch.Tensor, outer: torch.Tensor, bad: torch.Tensor, amax: torch.Tensor) -> Kept:
    """``stored``'s inverse (the GEMM part back in fp32)."""
    outer, bad, amax = (t if t.numel() else None for t in (outer, bad, amax))
    return Kept(Factored(inner.to(torch.float32), outer), bad, amax)


def recast_under_compile(plan: LinearPlan) -> bool:
    """True when a compiled backward reads W through an opaque copy (``formats.scaling.materialize``): when it
    casts W from W (``dgrad.weight`` quantized, read from the high-precision tensor). Otherwise the traced
    backward cast shares its first ops with the forward's (the fp32 upcast of W; with equal specs, the whole
    cast), torch.compile merges them, and its partitioner may keep the merged fp32 tensor from forward to
    backward instead of W (which is alive anyway: a parameter, or FSDP2's all-gather buffer that the backward
    fills again): 4 bytes an element of every such weight. With the copy the backward casts W again from W,
    as the eager backward does, with the same results."""
    spec = plan.spec("dgrad.weight")
    return spec is not None and spec.source == "high"


def backward_weight(w: torch.Tensor, plan: LinearPlan) -> torch.Tensor:
    """W as a backward casts it: through ``materialize`` while compiling where ``recast_under_compile``, else
    W itself (linear layers and the grouped experts)."""
    return materialize(w) if torch.compiler.is_compiling() and recast_under_compile(plan) else w


class QuantMatmul(torch.autograd.Function):
    """``y = x @ W^T`` with quantized forward, input-gradient and weight-gradient GEMMs.

    The layer's state tensors (key, statistics, flags, amax history) ride along as plain inputs and are kept
    on ``ctx`` (not saved tensors: the probes and delayed scaling update them in place, which would trip
    autograd's version check). Forward casts a backward role reads (``LinearPlan.saved_casts``) are saved, and
    those a backward role reuses (``LinearPlan.reused_casts``, as ``stored`` gives them; x itself is then not).
    The forward's delayed casts record their amaxes when the backward runs (saved as 1-element tensors; see
    ``nn.delayed``, "When the forward records"): the forward only reads the history, so an activation
    checkpoint's recompute reads it as the first pass did.
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
        # x (M, K), w (N, K); saved in high precision and cast again in backward per role, except the casts
        # a backward role reuses (plan.reused_casts; not on statistics steps, which record every role).
        ctx.plan, ctx.shards, ctx.mode, ctx.record = plan, shards, mode, record
        ctx.state = GemmState(key, stats, flags, history)
        ctx.dtypes = {"input": x.dtype, "weight": w.dtype}
        tensors = {"input": x, "weight": w}
        casts = None if mode.stats else {}
        deferred: Deferred = {}
        y = run_gemm("forward", tensors, plan, shards, ctx.state, mode, record, casts, defer=deferred)
        # the forward casts a backward role reuses (run_gemm keeps only those)
        ctx.carried = tuple(casts or {})
        carried = [t for n in ctx.carried for t in stored(casts[n], plan.spec(n), x.device)]
        needs_x = "input" not in (ROLES[i].operand for i in map(ROLE_NAMES.index, ctx.carried))
        kept = (tensors[name] for name in plan.saved_casts)
        ctx.deferred = tuple(deferred)
        ctx.save_for_backward(x if needs_x else None, w, *kept, *carried, *deferred.values())
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w, *rest = ctx.saved_tensors
        if ctx.deferred:  # the forward's delayed casts record now, once per forward (see the class doc)
            amaxes, rest = rest[-len(ctx.deferred) :], rest[: -len(ctx.deferred)]
            for i, amax in zip(ctx.deferred, amaxes, strict=True):
                delayed.record(ctx.state.history[i], ctx.plan.specs[i], amax)
        w = backward_weight(w, ctx.plan)
        n = len(ctx.plan.saved_casts)
        tensors = {"weight": w, "grad_output": dy} | ({"input": x} if x is not None else {})  # dy (M, N)
        tensors.update(zip(ctx.plan.saved_casts, rest[:n], strict=True))
        carried = rest[n:]
        casts = None if ctx.mode.stats else {}
        for j, name in enumerate(ctx.carried):
            casts[name] = restored(*carried[STORED * j : STORED * (j + 1)])
        dtypes = ctx.dtypes | {"grad_output": dy.dtype}
        dx = dw = None
        args = (tensors, ctx.plan, ctx.shards, ctx.state, ctx.mode, ctx.record, casts, dtypes)
        if ctx.needs_input_grad[0]:
            dx = run_gemm("dgrad", *args).to(ctx.dtypes["input"])
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
