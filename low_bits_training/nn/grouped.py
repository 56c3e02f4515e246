"""The quantized grouped GEMM of mixture-of-experts layers: every expert is a linear layer under one plan.

The routed tokens arrive sorted by expert: ``x`` (R, K), expert ``e`` owning rows ``offs[e-1]:offs[e]``
(``offs`` (E,) cumulative int32, as ``torch._grouped_mm`` takes them); rows past ``offs[-1]`` belong to no
expert (the padded tail of a static-size dispatch). The weights are stacked ``w`` (E, N, K), ``w[e]`` laid
out as a linear weight. Expert ``e`` computes ``y_e = x_e @ w[e]^T`` and, in backward, the dgrad and wgrad
GEMMs of a linear layer; the six roles of ``nn.roles`` apply to it unchanged (the same spec, the same
contraction-dim axis).

The "per expert group" casts are ``nn.group_cast``'s; this module groups the rows, runs the grouped GEMMs
(``grouped_mm``, an opaque op), and holds the autograd Function, its functional (``grouped_linear``) and the
plan state of a stacked expert weight (``GroupedQuantState``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from low_bits_training.formats import QuantSpec

from . import probe, rng
from .functional import backward_weight
from .gemm import GEMM_OPERANDS
from .group_cast import group_cast
from .probe import LayerState, ProbeMode
from .roles import GEMMS, ROLES, LinearPlan
from .state import QuantState

_TOKEN_OPERANDS = ("input", "grad_output")
_NO_STATE, _NO_PROBE = LayerState(), ProbeMode()


def pad_multiple(plan: LinearPlan) -> int:
    """The row multiple each expert's token group needs under ``plan`` (1: none).

    Blocks along the token dim (the wgrad roles' axis 0) and tiles over any token operand group rows; the
    result is the least common multiple of their sizes.
    """
    sizes = [
        s.block_size
        for s, r in zip(plan.specs, ROLES, strict=True)
        if s is not None
        and r.operand in _TOKEN_OPERANDS
        and (s.scaling == "tile" or (s.scaling == "block" and r.axis == 0))
    ]
    return math.lcm(1, *sizes)


def token_groups(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """The expert of every row: (rows,) int64 in 0..E, E for rows past ``offs[-1]``."""
    r = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, r, right=True)


def weight_groups(experts: int, rows_per_expert: int, device=None) -> torch.Tensor:
    """The expert of every row of the stacked weight viewed as (E * N, K)."""
    return torch.arange(experts, device=device).repeat_interleave(rows_per_expert)


@torch.library.custom_op("lbt::grouped_mm", mutates_args=())
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` for any float dtype (its compile-time shape function accepts only bf16).

    One matmul per group, in ``a``'s dtype (an opaque op under torch.compile; the emulation's reference
    GEMM, not a fast one). Forms: a (R, K) x b (E, K, N) -> (R, N), group e the rows ``offs[e-1]:offs[e]``
    of a, rows past ``offs[-1]`` 0; a (N, R) x b (R, K) -> (E, N, K), group e the columns / rows of R.
    """
    ends = offs.tolist()
    spans = [(e, s, t) for e, (s, t) in enumerate(zip([0, *ends[:-1]], ends, strict=True)) if t > s]
    if b.dim() == 3:
        out = a.new_zeros(a.shape[0], b.shape[-1])
        for e, s, t in spans:
            out[s:t] = a[s:t] @ b[e]
        return out
    out = a.new_zeros(len(ends), a.shape[0], b.shape[1])
    for e, s, t in spans:
        out[e] = a[:, s:t] @ b[s:t]
    return out


@grouped_mm.register_fake
def _grouped_mm_shape(a, b, offs):
    if b.dim() == 3:
        return a.new_empty(a.shape[0], b.shape[-1])
    return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])


class Groups:
    """The grouping of one grouped GEMM: token rows by expert, weight rows by expert."""

    def __init__(self, offs: torch.Tensor, rows: int, weight_shape: torch.Size):
        self.offs = offs
        self.experts, self.n, self.k = weight_shape
        self.tokens = token_groups(offs, rows)  # (R,)
        self.weights = weight_groups(self.experts, self.n, offs.device)  # (E * N,)

    def of(self, operand: str) -> torch.Tensor:
        return self.weights if operand == "weight" else self.tokens


def _operand(i: int, t: torch.Tensor, spec, groups: Groups, state: LayerState, mode: ProbeMode):
    key = rng.role_key(state.key, i) if spec is not None and spec.rounding == "stochastic" else None
    q = group_cast(t, spec, groups.of(ROLES[i].operand), groups.experts, key, ROLES[i].name)
    probe.record_operand(state, mode, i, t, spec, q if spec is not None else None)
    return q


def _grouped_view(q: torch.Tensor, operand: str, transpose: bool, groups: Groups) -> torch.Tensor:
    # The stacked weight goes to _grouped_mm as (E, N, K) (or its per-expert transpose); tokens stay 2-D.
    if operand == "weight":
        q = q.view(groups.experts, groups.n, groups.k)
        return q.transpose(-2, -1) if transpose else q
    return q.t() if transpose else q


def run_grouped_gemm(
    gemm: str,
    tensors: dict[str, torch.Tensor],
    plan: LinearPlan,
    groups: Groups,
    state: LayerState = _NO_STATE,
    mode: ProbeMode = _NO_PROBE,
) -> torch.Tensor:
    """One GEMM of every expert at once, operands cast per expert group (walks ``GEMM_OPERANDS``).

    Args:
        gemm: "forward" | "dgrad" | "wgrad".
        tensors: input (R, K), weight (E * N, K), grad_output (R, N).
        plan: the experts' plan.
        groups: the grouping (``Groups``).
        state: key and probe tensors (``nn.probe``).
        mode: what the probe records.

    Returns:
        fp32: forward (R, N), dgrad (R, K) (rows of no expert are 0), wgrad (E, N, K).
    """
    op = GEMM_OPERANDS[gemm]
    ra, rb = ROLES[op.a], ROLES[op.b]
    a = _operand(op.a, tensors[ra.operand], plan.specs[op.a], groups, state, mode)
    b = _operand(op.b, tensors[rb.operand], plan.specs[op.b], groups, state, mode)
    a = _grouped_view(a, ra.operand, op.a_t, groups)
    b = _grouped_view(b, rb.operand, op.b_t, groups)
    y = grouped_mm(a, b, groups.offs)
    probe.record_output(state, mode, GEMMS.index(gemm), y)
    return y


class GroupedQuantMatmul(torch.autograd.Function):
    """``y[rows of e] = x[rows of e] @ w[e]^T`` for every expert e, three GEMMs cast by one plan."""

    @staticmethod
    def forward(ctx, x, w, offs, key, stats, flags, plan: LinearPlan, mode: ProbeMode):
        # x (R, K), w (E, N, K), offs (E,) int32; saved in high precision and cast again in backward.
        ctx.save_for_backward(x, w, offs)
        ctx.plan, ctx.mode, ctx.state = plan, mode, LayerState(key, stats, flags)
        groups = Groups(offs, x.shape[0], w.shape)
        tensors = {"input": x, "weight": w.reshape(-1, w.shape[-1])}
        return run_grouped_gemm("forward", tensors, plan, groups, ctx.state, mode).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, w, offs = ctx.saved_tensors
        w = backward_weight(w, ctx.plan)
        groups = Groups(offs, x.shape[0], w.shape)
        tensors = {"input": x, "weight": w.reshape(-1, w.shape[-1]), "grad_output": dy}  # dy (R, N)
        args = (tensors, ctx.plan, groups, ctx.state, ctx.mode)
        dx = run_grouped_gemm("dgrad", *args).to(x.dtype) if ctx.needs_input_grad[0] else None
        dw = run_grouped_gemm("wgrad", *args).to(w.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None, None, None, None


def grouped_linear(
    x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, plan: LinearPlan, state: LayerState = _NO_STATE
) -> torch.Tensor:
    """The experts' linear maps with the plan's casts on all three GEMMs.

    Args:
        x: (R, K) expert-sorted tokens (each expert's rows padded to ``pad_multiple(plan)`` when needed).
        w: (E, N, K) stacked weights.
        offs: (E,) int32 cumulative row counts.
        plan: the experts' plan (the same for every expert); high-precision roles run in fp32.
        state: the key and probe tensors (``nn.probe``).

    Returns:
        (R, N) in x's dtype; rows past ``offs[-1]`` are 0.

    Raises:
        ValueError: an operand does not fit its spec (e.g. a block size that does not divide a dim).
    """
    return GroupedQuantMatmul.apply(x, w, offs, *tuple(state)[:3], plan, probe.mode())  # key, stats, flags


_PLAIN_OPTIONS = {"rht": 0, "amax_history": 0, "source": "high"}
"""The operand options the grouped GEMM lacks, at the values that turn them off."""


def grouped_spec(spec: QuantSpec | None) -> QuantSpec | None:
    """``spec`` as an expert weight takes it: RHT off, current scaling, cast from high precision (the grouped
    GEMM implements none of the three)."""
    return None if spec is None else dataclasses.replace(spec, **_PLAIN_OPTIONS)


class GroupedQuantState(QuantState, nn.Module):
    """The plan and the key / probe buffers of one stacked expert weight (no parameters): a ``QuantState``
    like ``QuantLinear``'s, so every tool reads an expert weight as it reads a linear layer.

    ``pad`` is the row multiple the experts module's dispatcher pads each expert's tokens to: a plan switched
    in mid-run (a phase, the autopilot) must need a divisor of it (``check_plan``)."""

    def __init__(self, plan: LinearPlan, name: str = "", device=None, pad: int = 1):
        super().__init__()
        self.plan, self.lbt_target, self.pad = plan, name, pad
        self.init_state_buffers(device, name)

    def fit_spec(self, spec: QuantSpec | None) -> QuantSpec | None:
        return grouped_spec(spec)

    def check_plan(self, plan: LinearPlan) -> None:
        need = pad_multiple(plan)
        if self.pad % need:
            raise ValueError(
                f"its blocks along the tokens need each expert's rows padded to a multiple of {need}; the "
                f"dispatcher pads to {self.pad} (a plan of some phase with those blocks pads for them)"
            )
        if any(s != grouped_spec(s) for s in plan.specs):
            raise ValueError("expert weights take no RHT, delayed scaling or forward-cast source")

    def extra_repr(self) -> str:
        return self.quantized_roles()
