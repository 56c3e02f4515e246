"""QuantLinear: ``nn.Linear`` whose three GEMMs follow a ``LinearPlan`` (a line over the functional)."""

from __future__ import annotations

import torch
from torch import nn

from . import delayed, probe, rng
from .functional import GemmState
from .roles import LinearPlan
from .tp import linear

STATE_BUFFERS = ("lbt_key", "lbt_stats", "lbt_flags")
"""Non-persistent buffers of a quantized layer (``probe.LayerState``): never in a checkpoint."""
HISTORY_BUFFER = "lbt_amax_history"
"""The persistent amax-history buffer of a layer with delayed-scaled roles (``nn.delayed``): checkpointed,
so a resumed run scales exactly as an uninterrupted one."""


class QuantLinear(nn.Linear):
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

    def init_state_buffers(self, device=None, name: str = "") -> None:
        """(Re)create the key and probe buffers on ``device``; the key derives from the layer's ``name``.
        With delayed-scaled roles also the amax history (``HISTORY_BUFFER``, persistent: in checkpoints)."""
        register_state_buffers(self, self.plan, device, name)

    def set_name(self, name: str) -> None:
        """Key this layer's random streams by its FQN (so every layer rounds with its own bits)."""
        self.lbt_key.fill_(rng.layer_key(name))

    @property
    def state(self) -> GemmState:
        return GemmState(self.lbt_key, self.lbt_stats, self.lbt_flags, getattr(self, HISTORY_BUFFER, None))

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
        n = sum(s is not None for s in self.plan.specs)
        return f"{super().extra_repr()}, quantized_roles={n}/6"


def register_state_buffers(module: nn.Module, plan: LinearPlan, device=None, name: str = "") -> None:
    """(Re)create a quantized module's state buffers (``STATE_BUFFERS``, non-persistent: the random key
    derived from ``name``, the probes) and, with delayed-scaled roles, the persistent amax history
    (``HISTORY_BUFFER``, in checkpoints). Shared by ``QuantLinear``, the attention products and the grouped
    experts."""
    key = torch.tensor(rng.layer_key(name), dtype=torch.int64, device=device)
    module.register_buffer("lbt_key", key, persistent=False)
    module.register_buffer("lbt_stats", probe.new_stats(device), persistent=False)
    module.register_buffer("lbt_flags", probe.new_flags(device), persistent=False)
    history = delayed.new_history(plan.specs, device)
    if history is not None:
        module.register_buffer(HISTORY_BUFFER, history, persistent=True)
