"""What a kind of plan target is, in one record, and the one adapter its state modules share in torchtitan.

A plan covers several kinds of target: linear layers (``titan.targets.linear``), MoE expert weights
(``titan.targets.experts``), attention products (``titan.targets.attention``) and FSDP2's collectives
(``titan.targets.wire``). Each kind module defines one ``TargetKind``; ``titan.targets.registry.TARGETS`` lists them,
and every consumer (the resolution, the converter, the schedule, doctor and the plan table, the numerics
monitor) loops over that list. Adding a kind is one new ``TargetKind`` (docs/precision_plan.md shows one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.protocols.module import Module

from low_bits_training.nn import LinearPlan
from low_bits_training.plan.resolve import LayerShape


def _none(*_args) -> dict:
    return {}


def _nothing(*_args) -> None:
    return None


@dataclass(frozen=True)
class TargetKind:
    """One kind of plan target: where its entries come from and how the run treats them.

    The GEMM kinds give entries (``LayerShape`` per FQN) that ``plan.resolve.resolve_plan`` resolves; a kind
    without entries (the collectives) only checks and hooks the config (``convert``).
    """

    name: str
    """Short name in logs and docs: ``linear``, ``experts``, ``attention``, ``wire``."""
    what: str
    """How an error names one entry: ``an MoE expert weight``."""
    switchable: bool
    """Whether its plan may change between phases of a schedule (``[[quantize.phases]]``) inside a run."""
    entries: Callable[[Any], dict[str, LayerShape]] = _none
    """config -> FQN -> shape of every entry of this kind in the model (before or after conversion)."""
    convert: Callable[[Any, Any], None] = _nothing
    """(config, ``titan.targets.registry.ResolvedRun``: its ``plans`` of step 1, ``keep()`` the FQNs to build
    quantized even where high) -> rewrite the model config tree (and the model spec) in place, before any
    model is built."""
    label: Callable[[dict[str, LinearPlan], str], str] = lambda plans, fqn: ""
    """(resolved plans, FQN) -> the module the converter builds for that entry (plan table, doctor)."""
    current: Callable[[Any], dict[str, tuple[LinearPlan, str]]] = _none
    """model config -> FQN -> (plan, module label) as the converted tree holds them."""
    converted: Callable[[Any], dict[str, str]] = _none
    """model config -> FQN -> module label of entries a base's own torchtitan converter swapped (not
    covered: ``skip`` may name them, rules may not)."""


def _device(module: torch.nn.Module) -> torch.device:
    key = getattr(module, "lbt_key", None)
    if key is not None:
        return key.device
    return next(module.parameters()).device


class TitanQuantState(Module):
    """torchtitan's Module protocol for a ``nn.state.QuantState``: the key / probe buffers are (re)made in
    ``init_states``, after torchtitan distributed the parameters (per rank, never sharded)."""

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        device = buffer_device if buffer_device is not None else _device(self)
        self.init_state_buffers(device, self.lbt_target)
