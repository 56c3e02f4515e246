"""Delayed scaling in the trainer: the amax group (``nn.delayed.set_amax_group``).

Ranks that see different data (data parallel x context parallel: torchtitan's "loss" mesh) compute different
current amaxes for the same operand; all-reduced MAX over that group before it enters the history, every rank
keeps the same history, so the scale is the same everywhere and the one copy a checkpoint stores of the
replicated buffer resumes every rank exactly. Tensor-parallel shards need no group here: ``nn.cast`` already
reduces a sharded operand's amax over its shards. Without delayed-scaled roles nothing is set (no collective).
"""

from __future__ import annotations

from low_bits_training.nn import delayed
from low_bits_training.nn.linear import HISTORY_BUFFER


def install(trainer) -> object | None:
    """Set the amax group for ``trainer``'s model (None and cleared: no delayed roles, or one data rank).

    Returns:
        The process group set, or None.
    """
    has_history = any(
        name.endswith(HISTORY_BUFFER) for part in trainer.model_parts for name, _ in part.named_buffers()
    )
    mesh = trainer.parallel_dims.get_optional_mesh("loss") if has_history else None
    group = None if mesh is None else mesh.get_group()
    delayed.set_amax_group(group)
    return group
