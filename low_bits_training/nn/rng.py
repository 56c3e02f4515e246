"""The random stream stochastic rounding in quantized layers draws from.

Not the global RNG: anything else that draws from it (a lazy first-step initialisation, a compile, a data
transform) would shift the numbers the layers get, so a resumed run would round differently from an
uninterrupted one. The trainer calls ``set_step_seed`` at the start of every step; each device then gets its
own generator seeded from (step seed, device), consumed in the deterministic order of the layers' casts.
Without a step seed (plain module use, tests), the global RNG is used.
"""

from __future__ import annotations

import torch

_step_seed: int | None = None
_generators: dict[torch.device, torch.Generator] = {}


def set_step_seed(seed: int | None) -> None:
    """Start the layers' streams for one step (None: fall back to the global RNG)."""
    global _step_seed
    _step_seed = seed
    _generators.clear()


def generator_for(device: torch.device) -> torch.Generator | None:
    """The current step's generator on ``device``, created on first use; None without a step seed."""
    if _step_seed is None:
        return None
    device = torch.device(device)
    gen = _generators.get(device)
    if gen is None:
        seed = (_step_seed + 1_000_003 * (device.index or 0)) & ((1 << 63) - 1)
        gen = _generators[device] = torch.Generator(device=device).manual_seed(seed)
    return gen
