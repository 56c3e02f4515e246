"""Bytes of training state measured on the live tensors of a run, the check on ``optim.budget``'s figures.

``live_bytes`` counts the storage (``untyped_storage().nbytes()``, padding included) of each parameter's local
shard, its gradient and every optimizer state on this rank, each storage once (FSDP2's gradients of a layer
share one reduce-scatter buffer), and names the states as ``optim.budget`` does (``state_name``).
``titan.runtime.budget`` sums it over the ranks; tests/titan/runtime/test_budget_train.py holds it equal to
``optim.budget.state_bytes``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .budget import StateBytes, dtype_name
from .dist import local
from .memory import inner_tensors


def state_name(key: str) -> str:
    """The budget's state of an optimizer state key: ``exp_avg_codes`` / ``exp_avg_scales`` -> ``exp_avg``."""
    for suffix in ("_codes", "_scales"):
        if key.endswith(suffix):
            return key.removesuffix(suffix)
    return key


def live_bytes(params: Iterable[torch.Tensor], optimizer_states: Iterable[dict[str, Any]]) -> StateBytes:
    """The bytes this rank holds, measured on the live tensors: the storage (``untyped_storage().nbytes()``,
    padding included) of each parameter's local shard, its gradient and every optimizer state, each storage
    counted once (FSDP2's gradients of a layer share one reduce-scatter buffer).

    Args:
        params: the parameters (DTensors or plain; each once).
        optimizer_states: ``optimizer.state[p]`` of every parameter of every optimizer.

    Returns:
        This rank's bytes per state; ``numel`` is the parameters' global element count.
    """
    out, seen = StateBytes(), set()

    def add(state: str, t: torch.Tensor) -> None:
        for s in inner_tensors(local(t)):
            key = (s.device, s.untyped_storage().data_ptr())
            if key not in seen or s.untyped_storage().nbytes() == 0:
                seen.add(key)
                out.add(state, s.untyped_storage().nbytes(), dtype_name(s.dtype))

    for p in params:
        out.numel += p.numel()
        add("params", p)
        if p.grad is not None:
            add("grads", p.grad)
        else:  # freed in the backward (``in_backward``), or not computed: the row is there, with no bytes
            out.add("grads", 0, "none held")
    for st in optimizer_states:
        for key, value in st.items():
            if torch.is_tensor(value):
                add(state_name(key), value)
    return out
