"""One GEMM of a quantized linear layer: the operand table, the operand casts and the emulated product.

Every GEMM is ``out = A @ B`` with both operands cast by their role's spec; the table ``GEMM_OPERANDS``
says which roles feed a GEMM and whether the natural (2-D) tensor is transposed after the cast. One
function (``run_gemm``) walks it for all three GEMMs. Per role, before the cast: the tensor it reads (the
operand, or the forward GEMM's cast of it, ``QuantSpec.source``) and a random Hadamard transform along the
contraction dim (``QuantSpec.rht``, ``formats.hadamard``); the cast itself may scale from an amax history
(delayed scaling, ``nn.delayed``). An emulated GEMM multiplies in bf16 where that is exact (``gemm_dtype``),
else in fp32 of the cast values. The autograd Function that runs the three GEMMs is ``nn.functional``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from low_bits_training.formats import Factored, QuantSpec, hadamard
from low_bits_training.formats.table import CodeFormat, IntFormat, get_format

from . import delayed, kernels, probe, rng
from .cast import ShardGroups, cast_factored
from .probe import NO_STATE, PROBE_OFF, LayerState, ProbeMode
from .roles import GEMMS, ROLES, LinearPlan, source_key

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
    """Significant bits of a format's values (floats: mantissa bits + 1; symmetric ints: magnitude bits;
    codebooks: what their values need, 24 for the dynamic tree)."""
    if isinstance(fmt, CodeFormat):
        return fmt.significant_bits
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
        t = hadamard.operand_rht(t, spec, axis)
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
