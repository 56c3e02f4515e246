"""``[memory]``: the peak-memory plan's limit and check (a ``Section``: checked when built). The plan itself is
``titan/runtime/peak.py``; the launcher's check is ``titan/launch/memory.py`` ``check_peak``; see
docs/memory.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar

from low_bits_training.config.section import AtLeast, Section

FREE_FRACTION = 0.92
"""The share of the limit a run's planned peak may take: the rest is left to the allocator's cache and
fragmentation, and to CUDA / NCCL workspaces the plan does not count."""


@dataclass(kw_only=True, slots=True)
class MemoryConfig(Section):
    """``[memory]``: plan each rank's peak before the run and refuse a run that would not fit."""

    SECTION: ClassVar[str] = "memory"

    plan: bool = True
    """Plan the peak before any rank starts and refuse (exit 2) a run over ``FREE_FRACTION`` of the limit."""
    limit_gib: Annotated[float, AtLeast(0, "0: the device's free memory")] = 0.0
    """GiB one rank may use (0: the device's free memory as the launcher sees it; on the CPU, the host's
    available memory). Set it to plan for a GPU from a machine without one (``--check-only``)."""
