"""QuantLinear: ``nn.Linear`` whose three GEMMs follow a ``LinearPlan`` (a line over the functional)."""

from __future__ import annotations

import torch
from torch import nn

from .roles import LinearPlan
from .state import HISTORY_BUFFER, STATE_BUFFERS, QuantState, register_state_buffers
from .tp import linear

__all__ = ["HISTORY_BUFFER", "STATE_BUFFERS", "QuantLinear", "register_state_buffers"]


class QuantLinear(QuantState, nn.Linear):
    """A drop-in ``nn.Linear``: same parameters and state_dict keys, quantized GEMMs.

    Checkpoints move freely between ``nn.Linear`` and ``QuantLinear`` (the plan is not state). Beside the
    parameters a QuantLinear carries three small non-persistent buffers (``STATE_BUFFERS``): its random
    key for stochastic rounding and its numerics probes (see ``nn.probe``), updated inside the compiled
    graph, so the layer compiles with ``fullgraph=True`` and needs no hooks. A plan with delayed-scaled
    roles adds one persistent buffer, the amax history (``HISTORY_BUFFER``): that layer's checkpoints carry it.
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
        self.init_state_buffers(device)

    @classmethod
    def from_linear(cls, lin: nn.Linear, plan: LinearPlan) -> QuantLinear:
        """A QuantLinear sharing ``lin``'s parameters."""
        q = cls(lin.in_features, lin.out_features, bias=lin.bias is not None, plan=plan, device="meta")
        q.weight, q.bias = lin.weight, lin.bias
        q.init_state_buffers(lin.weight.device)
        return q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.plan, self.state)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, {self.quantized_roles()}"
