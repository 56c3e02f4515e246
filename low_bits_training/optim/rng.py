"""Counter-based random streams for stochastic rounding: one ``torch.Generator`` per (param, step, use).

A generator is seeded from (group seed, parameter FQN, step, the shard's global offset, purpose) by a hash.
Its whole state is therefore a function of values the checkpoint already holds (the group's ``seed`` and the
parameter's ``step``): a resumed run draws exactly the numbers an uninterrupted one draws, on every rank,
with no generator state to save. Different shards (ranks) and parameters get independent streams.
"""

from __future__ import annotations

import hashlib

import torch


def stream_seed(seed: int, fqn: str, step: int, offset: tuple[int, ...], purpose: str) -> int:
    """A 63-bit seed for one random stream (blake2b of the identifying values)."""
    key = f"{seed}|{fqn}|{step}|{','.join(map(str, offset))}|{purpose}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def generator(
    seed: int, fqn: str, step: int, offset: tuple[int, ...], purpose: str, device: torch.device
) -> torch.Generator:
    """A generator on ``device`` seeded by ``stream_seed`` (see the module docstring)."""
    return torch.Generator(device=device).manual_seed(stream_seed(seed, fqn, step, offset, purpose))
