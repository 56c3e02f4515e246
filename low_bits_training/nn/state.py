"""The live state of one plan target: its plan, random key, probes and (delayed scaling) amax history.

Every module that runs quantized GEMMs of one plan entry (``QuantLinear``, one stacked expert weight, one
attention product) carries the same buffers and is read the same way by the numerics monitor, the
precision schedule and delayed scaling: through ``QuantState``. A new kind of target inherits it and is
seen by every tool at once.
"""

from __future__ import annotations

import torch
from torch import nn

from low_bits_training.formats import QuantSpec

from . import delayed, probe, rng
from .gemm import GemmState
from .roles import LinearPlan

STATE_BUFFERS = ("lbt_key", "lbt_stats", "lbt_flags")
"""Non-persistent buffers of a quantized target (``probe.LayerState``): never in a checkpoint."""
HISTORY_BUFFER = "lbt_amax_history"
"""The persistent amax-history buffer of a target with delayed-scaled roles (``nn.delayed``): checkpointed,
so a resumed run scales exactly as an uninterrupted one."""


def register_state_buffers(module: nn.Module, plan: LinearPlan, device=None, name: str = "") -> None:
    """(Re)create a quantized module's state buffers (``STATE_BUFFERS``, non-persistent: the random key
    derived from ``name``, the probes) and, with delayed-scaled roles, the persistent amax history
    (``HISTORY_BUFFER``, in checkpoints)."""
    key = torch.tensor(rng.layer_key(name), dtype=torch.int64, device=device)
    module.register_buffer("lbt_key", key, persistent=False)
    module.register_buffer("lbt_stats", probe.new_stats(device), persistent=False)
    module.register_buffer("lbt_flags", probe.new_flags(device), persistent=False)
    history = delayed.new_history(plan.specs, device)
    if history is not None:
        module.register_buffer(HISTORY_BUFFER, history, persistent=True)


class QuantState:
    """Mixin of an ``nn.Module`` that owns one plan target's state (no parameters of its own).

    Attributes:
        plan: the target's ``LinearPlan`` (six roles; the schedule may swap it between phases).
        lbt_target: the plan entry's name (``layers.0.attention.qk``), which may differ from the module's
            FQN; empty: the module's FQN is the entry's (a linear layer).
    """

    plan: LinearPlan
    lbt_target: str = ""

    def init_state_buffers(self, device=None, name: str = "") -> None:
        """(Re)create the key and probe buffers on ``device``; the key derives from ``name`` (the plan
        entry). With delayed-scaled roles also the amax history (``HISTORY_BUFFER``)."""
        register_state_buffers(self, self.plan, device, name)

    def set_name(self, name: str) -> None:
        """Key this target's random streams by its plan entry (so every target rounds with its own bits)."""
        self.lbt_key.fill_(rng.layer_key(name))

    @property
    def state(self) -> GemmState:
        """The key, probe and amax-history tensors the quantized GEMMs update in place."""
        return GemmState(self.lbt_key, self.lbt_stats, self.lbt_flags, getattr(self, HISTORY_BUFFER, None))

    def fit_spec(self, spec: QuantSpec | None) -> QuantSpec | None:
        """``spec`` as this target takes it when a role switches mid-run (the autopilot's promotions): the
        same, unless the target's kernel lacks some of its options (an expert weight's grouped GEMM)."""
        return spec

    def check_plan(self, plan: LinearPlan) -> None:
        """Raise ``ValueError`` (why, one line) when this target, as built, cannot run ``plan`` mid-run."""

    def quantized_roles(self) -> str:
        """``quantized_roles=N/6`` (for ``extra_repr``)."""
        return f"quantized_roles={sum(s is not None for s in self.plan.specs)}/6"


def clean_fqn(name: str) -> str:
    """A module's FQN without the wrappers torchtitan adds (activation checkpointing, torch.compile)."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def live_targets(modules: list[nn.Module]) -> list[tuple[str, QuantState]]:
    """``(plan entry, state module)`` of every quantized target in ``modules``, in model order (the forward
    execution order within a block), whatever its kind."""
    return [
        (mod.lbt_target or clean_fqn(fqn), mod)
        for part in modules
        for fqn, mod in part.named_modules()
        if isinstance(mod, QuantState)
    ]
