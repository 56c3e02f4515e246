"""The six GEMM operands of a linear layer: the cast table every plan, recipe and probe walks.

A linear layer y = x W^T (x: (M, K) tokens x in-features, W: (N, K)) runs three GEMMs:

======== =================== ======================= ===================
GEMM     product             operands                contraction dim
======== =================== ======================= ===================
forward  y  = x  @ W^T       input (M,K), weight (N,K)  K: axis -1, -1
dgrad    dx = dy @ W         grad_output (M,N), weight  N: axis -1, 0
wgrad    dW = dy^T @ x       grad_output, input         M: axis 0, 0
======== =================== ======================= ===================

Row / block scales run along the contraction dim of *their* GEMM (that is what a scaled GEMM kernel can
consume), so the same tensor gets a different ``axis`` in different GEMMs: the weight is blocked along K in
the forward and along N in dgrad; the activations and gradients along the token dim M in wgrad.

``nn.roles`` builds the per-layer plan (``LinearPlan``) over this table; ``nn.recipes`` names sets of specs by
it. Both read it from here, so neither needs the other to know the roles.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

Gemm = Literal["forward", "dgrad", "wgrad"]


class Role(NamedTuple):
    """One operand of one GEMM."""

    gemm: Gemm
    operand: Literal["input", "weight", "grad_output"]
    axis: int
    """The operand's contraction dim as a 2-D tensor (see the module table)."""

    @property
    def name(self) -> str:
        return f"{self.gemm}.{self.operand}"


ROLES: tuple[Role, ...] = (
    Role("forward", "input", -1),
    Role("forward", "weight", -1),
    Role("dgrad", "grad_output", -1),
    Role("dgrad", "weight", 0),
    Role("wgrad", "grad_output", 0),
    Role("wgrad", "input", 0),
)
"""The cast table: every operand of every GEMM, in a fixed order (``LinearPlan.specs`` follows it)."""

ROLE_NAMES: tuple[str, ...] = tuple(r.name for r in ROLES)
GEMMS: tuple[str, ...] = ("forward", "dgrad", "wgrad")
