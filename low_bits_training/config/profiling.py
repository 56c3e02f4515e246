"""``[profiling]``: the section's typed config (a ``Section``: checked when built). What it turns on (the
FLOP table, the memory timeline) runs in ``titan/runtime/profiling.py``; see docs/profiling.md."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar

from low_bits_training.config.section import AtLeast, Section


@dataclass(kw_only=True, slots=True)
class ProfilingConfig(Section):
    """``[profiling]``: one-step FLOP table and memory timeline (see docs/profiling.md)."""

    SECTION: ClassVar[str] = "profiling"

    flop_table_step: Annotated[int, AtLeast(0, "0: off")] = 0
    """Count FLOPs per module during this step (0: off); writes profiling/flops/step_<N>_rank<r>.txt/.json."""
    flop_table_depth: Annotated[int, AtLeast(1)] = 3
    """Module depth of the FLOP table (1: the model only, 3: ``layers.<i>.<block>``)."""
    memory_timeline_step: Annotated[int, AtLeast(0, "0: off")] = 0
    """Record this step's allocations and write profiling/memory_timeline/step_<N>_rank<r>.html/.json
    (0: off). Pick a step outside the ``[profiler]`` trace window: two profilers cannot run at once."""
