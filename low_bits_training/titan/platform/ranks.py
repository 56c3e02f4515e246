"""The one answer to "which rank is this process?", before and after the process group exists.

Before ``torch.distributed`` is initialised (config loading, the launcher) the rank comes from the ``RANK``
variable torchrun sets; afterwards from the process group. Outside torchrun it is 0.
"""

from __future__ import annotations

import os

import torch.distributed as dist


def rank() -> int:
    """This process's global rank (0 outside torchrun)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def is_rank0() -> bool:
    """True on the rank that writes run-wide files and prints run-wide messages."""
    return rank() == 0


def world_size() -> int:
    """Number of ranks (1 outside torchrun)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))
