"""``[profiling]``: the extras beside torchtitan's ``[profiler]`` (traces, CUDA memory snapshots).

- a FLOP table: ``torch.utils.flop_counter.FlopCounterMode`` over one whole training step (forward, backward,
  optimizer), per module, written as ``profiling/flops/step_<N>_rank<r>.txt`` (the table) and ``.json``
  (``{module: flops}``);
- a memory timeline that works on the CPU too: one step under ``torch.profiler.profile(profile_memory=True)``
  exported with ``export_memory_timeline`` to ``profiling/memory_timeline/step_<N>_rank<r>.html`` (a plot) and
  ``.json`` (``[times, sizes]`` by category). torchtitan's memory snapshots record nothing without CUDA.
See docs/profiling.md.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode
from torchtitan.tools.logging import logger

FLOPS_DIR = "profiling/flops"
TIMELINE_DIR = "profiling/memory_timeline"


@dataclass(kw_only=True, slots=True)
class ProfilingConfig:
    """``[profiling]``: one-step FLOP table and memory timeline (see docs/profiling.md)."""

    flop_table_step: int = 0
    """Count FLOPs per module during this step (0: off); writes profiling/flops/step_<N>_rank<r>.txt/.json."""
    flop_table_depth: int = 3
    """Module depth of the FLOP table (1: the model only, 3: ``layers.<i>.<block>``)."""
    memory_timeline_step: int = 0
    """Record this step's allocations and write profiling/memory_timeline/step_<N>_rank<r>.html/.json
    (0: off). Pick a step outside the ``[profiler]`` trace window: two profilers cannot run at once."""

    def check(self) -> None:
        """Raises: ValueError (one line) for a negative step or a depth < 1."""
        for name in ("flop_table_step", "memory_timeline_step"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"profiling.{name} = {v!r}: expected an int >= 0 (0: off)")
        if not isinstance(self.flop_table_depth, int) or self.flop_table_depth < 1:
            raise ValueError(f"profiling.flop_table_depth = {self.flop_table_depth!r}: expected an int >= 1")


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _path(folder: str, sub: str, step: int, ext: str) -> str:
    d = os.path.join(folder, sub)
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, f"step_{step}_rank{_rank()}.{ext}")


def format_flop_table(counts: dict, depth: int) -> str:
    """A plain-text table ``module | GFLOP | % | ops`` of FlopCounterMode's per-module counts.

    Args:
        counts: ``{module: {op: flops}}`` (``FlopCounterMode.get_flop_counts()``; "Global" is the total).
        depth: keep modules with at most this many dotted parts.
    """
    total = sum(counts.get("Global", {}).values()) or 1
    lines = [f"{'module':<48} {'GFLOP':>10} {'%':>6}  ops", "-" * 90]
    for mod, ops in counts.items():
        if mod != "Global" and mod.count(".") >= depth:
            continue
        n = sum(ops.values())
        top = ", ".join(str(op).removeprefix("aten.").split(".")[0] for op in ops)
        lines.append(f"{mod:<48} {n / 1e9:>10.4f} {100 * n / total:>6.1f}  {top}")
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def flop_table(folder: str, step: int, depth: int) -> Iterator[None]:
    """Count the FLOPs of the enclosed code per module; write the table and per-module totals.

    Args:
        folder: run folder.
        step: step number for the file names.
        depth: module depth of the text table.
    """
    mode = FlopCounterMode(display=False, depth=depth)
    with mode:
        yield
    counts = mode.get_flop_counts()
    with open(_path(folder, FLOPS_DIR, step, "txt"), "w") as f:
        f.write(format_flop_table(counts, depth))
    totals = {mod: sum(ops.values()) for mod, ops in counts.items()}
    with open(_path(folder, FLOPS_DIR, step, "json"), "w") as f:
        json.dump({"step": step, "total": mode.get_total_flops(), "modules": totals}, f, indent=1)
    logger.info(
        f"FLOP table of step {step}: {mode.get_total_flops() / 1e9:.3f} GFLOP, written to {FLOPS_DIR}"
    )


def _memory_device() -> str:
    return f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"


@contextlib.contextmanager
def memory_timeline(folder: str, step: int) -> Iterator[None]:
    """Record the enclosed code's allocations and export the memory timeline (HTML plot and JSON).

    Args:
        folder: run folder.
        step: step number for the file names.
    """
    if torch.autograd.profiler._is_profiler_enabled:  # torchtitan's [profiler] window covers this step
        logger.warning(f"profiling.memory_timeline_step = {step}: a profiler is already running; skipped")
        yield
        return
    prof = torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU]
        + ([torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else []),
        profile_memory=True,
        record_shapes=True,
        with_stack=True,
    )
    with prof:
        yield
    dev = _memory_device()
    for ext in ("html", "json"):
        prof.export_memory_timeline(_path(folder, TIMELINE_DIR, step, ext), device=dev)
    logger.info(f"Memory timeline of step {step} written to {TIMELINE_DIR}")


def step_context(config: ProfilingConfig, folder: str, step: int) -> contextlib.ExitStack:
    """The profiling extras that apply to ``step`` (an empty context on other steps)."""
    stack = contextlib.ExitStack()
    if config.memory_timeline_step == step:
        stack.enter_context(memory_timeline(folder, step))
    if config.flop_table_step == step:
        stack.enter_context(flop_table(folder, step, config.flop_table_depth))
    return stack
