"""Where stochastic rounding in quantized layers gets its random bits: counter-based keys, no generators.

The bits of one cast are ``formats.random_bits(shape, key)`` with

    key = fold_key(step_key XOR layer_key, role index)

- ``step_key``: one int64 tensor for the whole process, set by the trainer before every microbatch from
  ``derive_key(seed, step, microbatch, rank)`` (``set_step_key``). It is a graph *input* under torch.compile
  (read at run time, never baked in), so a new step needs no recompile.
- ``layer_key``: a per-layer int64 buffer (``derive_key(fqn)``), so every layer draws other bits.
- the role index (0..5, ``nn.roles.ROLES``): the same for every layer, a constant in the graph.

A resumed run therefore rounds exactly as an uninterrupted one (everything derives from the seed and the
step), compiled and eager runs round alike, and nothing else that draws from torch's RNG shifts the bits.
Without a step key (plain module use outside the trainer) SR falls back to torch's global RNG.
"""

from __future__ import annotations

import torch

from low_bits_training.formats import derive_key, fold_key

_KEY_MASK = (1 << 62) - 1
_state: dict[str, torch.Tensor | None] = {"step": None}


def set_step_key(key: int | None) -> None:
    """Set (in place, so compiled graphs see it) or clear the process-wide step key."""
    if key is None:
        _state["step"] = None
    elif _state["step"] is None:
        _state["step"] = torch.tensor(key & _KEY_MASK, dtype=torch.int64)
    else:
        _state["step"].fill_(key & _KEY_MASK)


def step_key() -> torch.Tensor | None:
    """The current step key tensor (CPU int64, 0-d), or None when unset."""
    return _state["step"]


def layer_key(fqn: str) -> int:
    """The key of a layer named ``fqn`` (the same on every rank and in every run)."""
    return derive_key("layer", fqn) & _KEY_MASK


def role_key(layer: torch.Tensor | None, role: int) -> torch.Tensor | None:
    """The SR key of one role of one layer in the current step, or None (torch's global RNG).

    Args:
        layer: the layer's int64 key buffer (0-d), or None for a layer without one.
        role: index into ``nn.roles.ROLES`` (or any small int naming a cast of the layer).
    """
    step = _state["step"]
    if step is None:
        return None
    base = step if layer is None else torch.bitwise_xor(step.to(layer.device), layer)
    return fold_key(base, role)
