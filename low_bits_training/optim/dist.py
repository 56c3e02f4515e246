"""DTensor plumbing for optimizer states: work on local shards, store states with the parameter's placements.

Numerics never see a DTensor: the optimizer reads ``local(p)``, computes, and writes back local tensors.
A state tensor derived from a parameter shard (same leading dims) is wrapped as a DTensor with the
parameter's mesh and placements and its own global shape, so DCP saves and reshards it like the parameter.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from low_bits_training.upstream import compute_local_shape_and_global_offset, unset_fake_temporarily


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (a plain tensor is its own shard)."""
    return t.to_local() if isinstance(t, DTensor) else t


def shard_group(t: torch.Tensor):
    """The process group over which the local pieces of ``t`` add up to the whole: its mesh's group when ``t``
    is a DTensor sharded on a 1-D mesh (FSDP2's gradients), else None (a plain tensor, or one replicated)."""
    if isinstance(t, DTensor) and t.device_mesh.ndim == 1 and any(pl.is_shard() for pl in t.placements):
        return t.device_mesh.get_group()
    return None


def global_offset(p: torch.Tensor) -> tuple[int, ...]:
    """Global index of the first element of this rank's shard of ``p`` (zeros for a plain tensor)."""
    if not isinstance(p, DTensor):
        return (0,) * p.dim()
    with (
        unset_fake_temporarily()
    ):  # shape arithmetic (torch makes index tensors): real under the planner's fake mode
        _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(offset)


def shards_like(p: torch.Tensor, global_shape: tuple[int, ...], local_shape: tuple[int, ...]) -> bool:
    """True when a tensor of ``global_shape`` placed like ``p`` has exactly ``local_shape`` on this rank."""
    if not isinstance(p, DTensor):
        return tuple(global_shape) == tuple(local_shape)
    with unset_fake_temporarily():
        shape, _ = compute_local_shape_and_global_offset(global_shape, p.device_mesh, p.placements)
    return tuple(shape) == tuple(local_shape)


def wrap_like(p: torch.Tensor, t: torch.Tensor, global_shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` (this rank's local part) as a DTensor placed like ``p`` with ``global_shape``; plain if p is."""
    if not isinstance(p, DTensor):
        return t
    stride = torch.empty(global_shape, device="meta").stride()
    return DTensor.from_local(
        t, p.device_mesh, p.placements, run_check=False, shape=global_shape, stride=stride
    )
