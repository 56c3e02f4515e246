"""QuantLinear: ``nn.Linear`` whose three GEMMs follow a ``LinearPlan`` (a line over the functional)."""

from __future__ import annotations

import torch
from torch import nn

from .roles import LinearPlan
from .tp import linear


class QuantLinear(nn.Linear):
    """A drop-in ``nn.Linear``: same parameters and state_dict keys, quantized GEMMs.

    Checkpoints move freely between ``nn.Linear`` and ``QuantLinear`` (the plan is not state).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        plan: LinearPlan | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.plan = plan or LinearPlan()

    @classmethod
    def from_linear(cls, lin: nn.Linear, plan: LinearPlan) -> QuantLinear:
        """A QuantLinear sharing ``lin``'s parameters."""
        q = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, plan=plan, device="meta")
        q.weight, q.bias = lin.weight, lin.bias
        return q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.plan)

    def extra_repr(self) -> str:
        n = sum(s is not None for s in self.plan.specs)
        return f"{super().extra_repr()}, quantized_roles={n}/6"
