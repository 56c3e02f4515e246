"""Where stochastic rounding in quantized layers gets its random bits: counter-based keys, no generators.

The bits of one cast are ``formats.random_bits(shape, key)`` with

    key = fold_key(step_key XOR layer_key, role index)

- ``step_key``: one int64 tensor for the whole process, set by the trainer before every microbatch from
  ``derive_key(seed, step, microbatch, rank)`` (``set_step_key``). It is a graph *input* under torch.compile
  (read at run time, never baked in), so a new step needs no recompile. Where an accelerator is present a
  second copy lives on it (``step_key_on``), filled in place with the same value: a layer there reads its
  key without a host-to-device copy, so a CUDA graph that captured the step reads each microbatch's key on
  replay (a copy from the CPU tensor would be refused during capture, or replay the captured value).
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
_state: dict[str, torch.Tensor | None] = {"step": None, "device": None}


def accelerator() -> torch.device | None:
    """The accelerator device this process's layers live on (torchtitan sets it per rank), or None."""
    if not torch.accelerator.is_available():
        return None
    kind = torch.accelerator.current_accelerator()
    return torch.device(kind.type, torch.accelerator.current_device_index())


def set_step_key(key: int | None) -> None:
    """Set or clear the process-wide step key: the CPU tensor and its copy on the ``accelerator()``, both
    filled in place (compiled graphs and captured CUDA graphs read them at run time; ``fill_`` with a
    Python int is a kernel with a scalar argument, no host-to-device copy)."""
    if key is None:
        _state["step"] = _state["device"] = None
        return
    key &= _KEY_MASK
    if _state["step"] is None:
        device = accelerator()
        _state["step"] = torch.full((), key, dtype=torch.int64)
        _state["device"] = None if device is None else torch.full((), key, dtype=torch.int64, device=device)
    else:
        for t in (_state["step"], _state["device"]):
            if t is not None:
                t.fill_(key)


def step_key() -> torch.Tensor | None:
    """The current step key tensor (CPU int64, 0-d), or None when unset."""
    return _state["step"]


def step_key_on(device: torch.device) -> torch.Tensor | None:
    """The current step key on ``device`` (int64, 0-d), or None when unset: the accelerator's own copy, the
    CPU tensor, or (a device of neither kind) a copy made here."""
    step, on_device = _state["step"], _state["device"]
    if step is None:
        return None
    if on_device is not None and on_device.device == device:
        return on_device
    return step if step.device == device else step.to(device)


def layer_key(fqn: str) -> int:
    """The key of a layer named ``fqn`` (the same on every rank and in every run)."""
    return derive_key("layer", fqn) & _KEY_MASK


def role_key(layer: torch.Tensor | None, role: int) -> torch.Tensor | None:
    """The SR key of one role of one layer in the current step, or None (torch's global RNG).

    Args:
        layer: the layer's int64 key buffer (0-d), or None for a layer without one.
        role: index into ``nn.roles.ROLES`` (or any small int naming a cast of the layer).
    """
    if _state["step"] is None:
        return None
    base = _state["step"] if layer is None else torch.bitwise_xor(step_key_on(layer.device), layer)
    return fold_key(base, role)
