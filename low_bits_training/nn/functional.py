"""The quantized matmul: one autograd.Function whose three GEMMs follow a ``LinearPlan``.

Every GEMM is ``out = A @ B`` with both operands cast by their role's spec; the table ``GEMM_OPERANDS``
says which roles feed a GEMM and whether the natural (2-D) tensor is transposed after the cast. One
function (``run_gemm``) walks it for all three GEMMs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from . import kernels, observe
from .cast import ShardGroups, cast
from .roles import ROLES, LinearPlan

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


def run_gemm(gemm: str, tensors: dict[str, torch.Tensor], plan: LinearPlan, shards: Shards) -> torch.Tensor:
    """One GEMM of the layer, operands cast as the plan says.

    Args:
        gemm: "forward" | "dgrad" | "wgrad".
        tensors: natural 2-D operands by name: input (M,K), weight (N,K), grad_output (M,N).
        plan: the layer's plan.
        shards: sharded dims per operand (tensor parallelism), see ``Shards``.

    Returns:
        fp32 product (forward (M,N), dgrad (M,K), wgrad (N,K)).
    """
    op = GEMM_OPERANDS[gemm]
    ra, rb = ROLES[op.a], ROLES[op.b]
    sa, sb = plan.specs[op.a], plan.specs[op.b]
    a, b = tensors[ra.operand], tensors[rb.operand]
    ga, gb = shards.get(ra.operand, ()), shards.get(rb.operand, ())
    observe.emit(((ra, a, sa), (rb, b, sb)))  # statistics / NaN checks (no-op unless installed)
    if plan.backend(gemm) == "real" and (sa is not None or sb is not None):
        return observe.output(gemm, kernels.scaled_mm(a, sa, op.a_t, ga, b, sb, op.b_t, gb))
    a, b = cast(a, sa, ga), cast(b, sb, gb)
    return observe.output(gemm, (a.t() if op.a_t else a) @ (b.t() if op.b_t else b))


class QuantMatmul(torch.autograd.Function):
    """``y = x @ W^T`` with quantized forward, input-gradient and weight-gradient GEMMs."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, plan: LinearPlan, shards: Shards) -> torch.Tensor:
        # x (M, K), w (N, K); saved in high precision, cast again in backward per role.
        ctx.save_for_backward(x, w)
        ctx.plan, ctx.shards = plan, shards
        return run_gemm("forward", {"input": x, "weight": w}, plan, shards).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        tensors = {"input": x, "weight": w, "grad_output": dy}  # dy (M, N)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = run_gemm("dgrad", tensors, ctx.plan, ctx.shards).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = run_gemm("wgrad", tensors, ctx.plan, ctx.shards).to(w.dtype)
        return dx, dw, None, None


def quant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    plan: LinearPlan,
    shards: Shards | None = None,
) -> torch.Tensor:
    """``F.linear`` with the plan's casts on all three GEMMs (plain tensors; see ``tp.py`` for DTensors).

    Args:
        x: (..., K) input.
        weight: (N, K).
        bias: (N,) or None; added in high precision.
        plan: the layer's plan; an all-high-precision plan is exactly ``F.linear``.
        shards: sharded dims per operand when these are TP-local shards.

    Returns:
        (..., N) in x's dtype.

    Raises:
        ValueError: an operand's shape does not fit its spec (e.g. a block size that does not divide it).
    """
    if plan.is_high_precision:
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    y = QuantMatmul.apply(x.reshape(-1, x.shape[-1]), weight, plan, shards or {})  # (M, N)
    y = y.reshape(*lead, weight.shape[0])
    return y if bias is None else y + bias
