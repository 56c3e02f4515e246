"""Random bits for stochastic rounding of states and master weights: counter-based keys, no generators.

Each (parameter shard, step, use, chunk) gets one int64 key, ``formats.derive_key(seed, fqn, step, offset,
purpose, start)`` (the package's one seed-derivation scheme); ``formats.random`` turns it into the bits of the
chunk (element i gets hash(key, i)), the same eagerly and under torch.compile, where a ``torch.Generator``
cannot go. A key is a function of values the checkpoint already holds (the group's ``seed``, the parameter's
``step``), so a resumed run draws exactly what an uninterrupted one draws, with no generator state to save.
Shards (``offset``: the shard's global index), parameters, steps, uses and chunks (``start``: the chunk's
first element in the shard) get independent streams.
"""

from __future__ import annotations

import torch

from low_bits_training.formats import derive_key


def chunk_keys(
    seed: int,
    fqn: str,
    step: int,
    offset: tuple[int, ...],
    purposes: tuple[str, ...],
    starts: list[int],
    device: torch.device,
) -> torch.Tensor | None:
    """Keys of every chunk and use of one parameter shard at one step.

    Args:
        seed: the group's ``seed`` option.
        fqn: the parameter's name (``param_names`` of its group).
        step: the parameter's step (1 on the first update).
        offset: global index of the shard's first element (zeros unsharded).
        purposes: the uses drawing random bits ("exp_avg", "master", ...); none gives None.
        starts: first element (in the shard) of each chunk.
        device: where the keys go (the parameter's device).

    Returns:
        int64 tensor (chunks, purposes), or None when no use draws random bits.
    """
    if not purposes:
        return None
    keys = [[derive_key(seed, fqn, step, offset, p, s) for p in purposes] for s in starts]
    return torch.tensor(keys, dtype=torch.int64).to(device, non_blocking=True)
