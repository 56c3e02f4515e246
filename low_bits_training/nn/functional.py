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

from low_bits_training.formats import Factored, QuantSpec, hadamard
from low_bits_training.formats.rounding import native_fp8_dtype
from low_bits_training.formats.scaling import materialize
from low_bits_training.formats.table import IntFormat, get_format

from . import delayed, kernels, probe, rng
from .cast import ShardGroups, cast_factored
from .probe import NO_STATE, PROBE_OFF, LayerState, ProbeMode
from .roles import GEMMS, ROLE_NAMES, ROLES, LinearPlan, source_key

Shards = dict[str, ShardGroups]
"""Per operand name ("input", "weight", "grad_output"): its sharded dims under TP (empty: not sharded)."""
Dtypes = dict[str, torch.dtype]
"""Per operand name ("input", "weight", "grad_output"): the dtype of the natural (high-precision) tensor."""


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


def significant_bits(fmt) -> int:
    """Significant bits of a format's values (floats: mantissa bits + 1; symmetric ints: magnitude bits)."""
    return fmt.bits - 1 if isinstance(fmt, IntFormat) else fmt.mbits + 1


def exact_in_bf16(spec: QuantSpec | None, dtype: torch.dtype) -> bool:
    """True when every value of an operand's GEMM part (``Factored.inner`` of its cast, or, for ``None``,
    the operand itself in ``dtype``) is a bf16 number: element and in-block scale significands together of
    <= 8 bits (a power-of-two scale adds none; an exact block scale its format's; a tensor / per-row scale of
    exact rounding or under a two-level tensor scale, and a two-level tensor scale itself, are applied to
    the GEMM's result instead, ``formats.has_outer_scale``).
    Blocks whose scale lies below 2**-124 (amax below ~2**-116) are the exception: their smallest elements
    would fall under bf16's subnormal floor; no training tensor comes near it."""
    if spec is None:
        return dtype == torch.bfloat16
    bits = significant_bits(spec.elem)
    if spec.scaling in ("block", "tile"):
        bits += 0 if spec.scale_rounding != "exact" else significant_bits(get_format(spec.scale_format))
    return bits <= 8


def gemm_dtype(gemm: str, dtypes: Dtypes, sa: QuantSpec | None, sb: QuantSpec | None) -> torch.dtype:
    """The dtype an emulated GEMM multiplies in: bf16 when its result is returned in bf16 and both
    operands' GEMM parts are bf16 numbers (``exact_in_bf16``), else fp32 (the cast values).

    In bf16 the GEMM is what a low-precision kernel does: exact products of the grid values (times their
    in-block scales), fp32 accumulation, the scales that factor out of the sums (``Factored.outer``: fp8
    tensorwise's, NVFP4's tensor scale) applied to the fp32 result as a scaled GEMM's epilogue does, and one
    rounding to bf16. Against an fp32 GEMM of the cast values it differs in accumulation order and, with
    outer scales, where they round. It runs 3-6x faster on CPUs with AMX (``kernels.cpu_bf16_gemm``): a
    bf16 GEMM with a bf16 result where no outer scale follows, else a bf16-input GEMM that accumulates into
    fp32 (``kernels.mm_fp32_accumulate``; without AMX oneDNN's fp32 kernel, and the bf16 GEMM slower than
    it). fp32 results (fp32 activations) keep the fp32 GEMM of the cast values, which torchao's emulated
    modules also run (bit for bit with them).
    """
    out = dtypes[GEMM_OUTPUT[gemm]]
    op = GEMM_OPERANDS[gemm]
    da, db = (dtypes[ROLES[i].operand] for i in (op.a, op.b))
    exact = exact_in_bf16(sa, da) and exact_in_bf16(sb, db)
    return torch.bfloat16 if out == torch.bfloat16 and exact else torch.float32


def product(gemm: str, dtypes: Dtypes, fa: Factored, fb: Factored, sa, sb) -> torch.Tensor:
    """``A @ B`` of two cast operands (natural orientation, ``GEMM_OPERANDS`` transposes), in the dtype
    ``gemm_dtype`` gives: bf16 (a bf16 result directly, or fp32 accumulation times the outer scales), or
    fp32 of the cast values.

    The outer scales multiply the fp32 result as a scaled GEMM's epilogue does: two per-tensor scales as
    one product (cuBLAS's alpha), per-row / per-column scales one after the other.
    """
    op = GEMM_OPERANDS[gemm]

    def oriented(t: torch.Tensor | None, transpose: bool) -> torch.Tensor | None:
        return t.t() if transpose and t is not None else t

    if gemm_dtype(gemm, dtypes, sa, sb) == torch.float32:
        return oriented(fa.value(), op.a_t) @ oriented(fb.value(), op.b_t)
    if fa.outer is None and fb.outer is None:
        return oriented(fa.inner.bfloat16(), op.a_t) @ oriented(fb.inner.bfloat16(), op.b_t)
    y = kernels.mm_fp32_accumulate(oriented(fa.inner, op.a_t), oriented(fb.inner, op.b_t))
    oa, ob = oriented(fa.outer, op.a_t), oriented(fb.outer, op.b_t)
    if oa is not None and ob is not None and oa.numel() == ob.numel() == 1:
        return y * (oa * ob)
    for o in (oa, ob):
        if o is not None:
            y = y * o
    return y


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


class Kept(NamedTuple):
    """A cast that a later role of the same tensor reuses (``LinearPlan.reused_casts``)."""

    cast: Factored
    bad: torch.Tensor | None
    """The non-finite flag value its operand recorded (None: flags off)."""
    amax: torch.Tensor | None = None
    """The amax it recorded into its role's delayed-scaling history (None: none recorded)."""


Casts = dict[str, Kept]
"""Casts by role name that later GEMMs of the layer reuse (see ``run_gemm``)."""
Deferred = dict[int, torch.Tensor]
"""Role index -> the amax a delayed cast took, to record into its history later (``nn.delayed``, "When the
forward records")."""


def cast_operand(
    i: int,
    t: torch.Tensor,
    spec,
    shards,
    state: GemmState,
    mode: ProbeMode,
    record: bool,
    keep: Casts | None = None,
    defer: Deferred | None = None,
) -> Factored:
    """Cast one operand (role ``ROLES[i]``; stochastic rounding keyed by ``rng.role_key(state.key, i)``,
    delayed scaling from ``state.history[i]``) and record it in the layer's probe; ``keep``: also put the
    cast there under the role's name; ``defer``: a delayed cast leaves the history as it is and puts the
    amax it would record there (under ``i``) instead."""
    key = rng.role_key(state.key, i) if spec is not None and spec.rounding == "stochastic" else None
    history = (
        state.history[i] if state.history is not None and spec is not None and spec.amax_history else None
    )
    if history is not None and defer is not None:
        history = history.clone()  # the cast reads the row as it is and records into this copy only
    f = cast_factored(t, spec, shards, key, ROLES[i].name, history, record)
    bad = probe.record_operand(
        state, mode, i, t, spec, f.value() if spec is not None and mode.stats else None
    )
    amax = history[:1].clone() if history is not None and record else None  # the amax it recorded
    if defer is not None and amax is not None:
        defer[i] = amax
    if keep is not None:
        keep[ROLES[i].name] = Kept(f, bad, amax)
    return f


def run_gemm(
    gemm: str,
    tensors: dict[str, torch.Tensor],
    plan: LinearPlan,
    shards: Shards,
    state: LayerState | GemmState = NO_STATE,
    mode: ProbeMode = PROBE_OFF,
    record: bool = False,
    casts: Casts | None = None,
    dtypes: Dtypes | None = None,
    defer: Deferred | None = None,
) -> torch.Tensor:
    """One GEMM of the layer, operands cast as the plan says.

    Args:
        gemm: "forward" | "dgrad" | "wgrad".
        tensors: natural 2-D operands by name: input (M,K), weight (N,K), grad_output (M,N); each cast this
            GEMM makes is added under its role name (``forward.weight``, ...), where a later GEMM's role
            with ``source = "forward"`` reads it. An operand whose every role here reuses a cast may be
            missing.
        plan: the layer's plan.
        shards: sharded dims per operand (tensor parallelism), see ``Shards``.
        state: the layer's key, probe and amax-history tensors (``nn.probe``, ``nn.delayed``); empty: global
            RNG for SR, no probes, current scaling.
        mode: what the probe records.
        record: delayed-scaled casts push their amax into the history (training; see ``nn.delayed``).
        casts: None: cast every operand. Else earlier GEMMs' casts by role name: a role that
            ``plan.reused_casts`` maps to one of them takes it instead of casting (its flag is the earlier
            role's, ``probe.record_flag``), and this GEMM adds the casts a later role reuses.
        dtypes: the natural operands' dtypes (default: from ``tensors``).
        defer: delayed-scaled casts read their history without extending it and put the amax they would
            record here instead (``cast_operand``); the caller records them later (``QuantMatmul``).

    Returns:
        the product (forward (M,N), dgrad (M,K), wgrad (N,K)): fp32, or bf16 where ``gemm_dtype`` says.
    """
    state = GemmState(*state)
    op = GEMM_OPERANDS[gemm]
    sa, sb = plan.specs[op.a], plan.specs[op.b]
    dtypes = dtypes or {name: t.dtype for name, t in tensors.items()}
    ga, gb = shards.get(ROLES[op.a].operand, ()), shards.get(ROLES[op.b].operand, ())
    if plan.backend(gemm) == "real" and (sa is not None or sb is not None):
        a, b = source_operand(op.a, tensors, sa), source_operand(op.b, tensors, sb)
        probe.record_operand(state, mode, op.a, a, sa)
        probe.record_operand(state, mode, op.b, b, sb)
        y = kernels.scaled_mm(a, sa, op.a_t, ga, b, sb, op.b_t, gb)
    else:
        reuse = plan.reused_casts if casts is not None else {}
        kept_for_later = set(reuse.values())
        fs = []
        for i, spec, groups in ((op.a, sa, ga), (op.b, sb, gb)):
            name = ROLES[i].name
            if name in reuse and reuse[name] in casts:
                kept = casts[reuse[name]]
                probe.record_flag(state, i, kept.bad)
                if kept.amax is not None:  # keep this role's history equal to the earlier role's
                    delayed.record(state.history[i], spec, kept.amax)
                fs.append(kept.cast)
                continue
            t = source_operand(i, tensors, spec)
            keep = casts if name in kept_for_later else None
            f = cast_operand(i, t, spec, groups, state, mode, record, keep, defer)
            if name in plan.saved_casts:  # a backward role casts this forward cast again
                tensors[name] = f.value()
            fs.append(f)
        y = product(gemm, dtypes, *fs, sa, sb)
    probe.record_output(state, mode, GEMMS.index(gemm), y)
    return y


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
