"""Memory as torch's allocator hands it out: the peak while a function runs (what an optimizer step costs),
and what spans of work still hold when they end (``HeldBytes``: what a module keeps for its backward).

On CUDA this is ``torch.cuda.max_memory_allocated``. The CPU allocator keeps no statistics, but it reports every
allocation and free to the profiler (``profile_memory=True``); the running sum of those events gives the
peak. Python objects and compiler work (torch.compile's first call) are not tensor allocations and are not
counted: the process's peak RSS shows those (benchmarks/bench_optim.py reports both).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function


def allocated_peak(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Bytes allocated at the peak while ``fn()`` runs, above what was allocated when it started.

    Args:
        fn: the work to measure (e.g. ``opt.step``).
        device: where its tensors live ("cpu" or a CUDA device).

    Returns:
        The peak of (bytes allocated - bytes freed) over the call, >= 0.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU:
            now += e.nbytes()
            peak = max(peak, now)
    return peak


class HeldBytes:
    """What the allocator handed out inside named spans of work and still held when each span ended, less
    the span's output: what a module's forward keeps for its backward, as the allocator sees it.

    On CUDA ``torch.cuda.memory_allocated`` before and after each span; on the CPU the profiler's allocation
    and free events (``profile_memory=True``) over ``recording()``, each span a ``record_function`` range
    inside it, less the events inside ranges named ``exclude`` (prefixes: ``"FSDP::"`` leaves out FSDP2's
    parameter all-gathers, whose buffer a block frees only in the next block's call). A span entered several
    times (microbatches) adds up.
    """

    PREFIX = "lbt_held::"

    def __init__(self, device: torch.device | str = "cpu", exclude: tuple[str, ...] = ()):
        self.device = torch.device(device)
        self.exclude = exclude
        self.net: dict[str, int] = {}
        self.outputs: dict[str, int] = {}

    @contextlib.contextmanager
    def recording(self):
        """Around all the spans (a training step): the figures start from zero."""
        self.net, self.outputs = {}, {}
        if self.device.type == "cuda":
            yield self
            return
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield self
        events = list(prof.profiler.kineto_results.events())
        skip = sorted(
            (e.start_ns(), e.end_ns()) for e in events if self.exclude and e.name().startswith(self.exclude)
        )
        starts, ends = [a for a, _ in skip], list(itertools.accumulate((b for _, b in skip), max))

        def skipped(ns: int) -> bool:  # inside some excluded range
            i = bisect.bisect_right(starts, ns)
            return i > 0 and ends[i - 1] >= ns

        mem = sorted(
            (e.start_ns(), e.nbytes())
            for e in events
            if e.name() == "[memory]"
            and e.device_type() == torch.autograd.DeviceType.CPU
            and not skipped(e.start_ns())
        )
        times, total = [t for t, _ in mem], list(itertools.accumulate(n for _, n in mem))

        def upto(ns: int) -> int:  # bytes allocated - freed by the events at or before ns
            i = bisect.bisect_right(times, ns)
            return total[i - 1] if i else 0

        for e in events:
            if e.name().startswith(self.PREFIX):
                name = e.name()[len(self.PREFIX) :]
                self.net[name] = self.net.get(name, 0) + upto(e.end_ns()) - upto(e.start_ns())

    @contextlib.contextmanager
    def span(self, name: str):
        """One span of work named ``name``."""
        if self.device.type == "cuda":
            before = torch.cuda.memory_allocated(self.device)
            yield
            self.net[name] = self.net.get(name, 0) + torch.cuda.memory_allocated(self.device) - before
            return
        with record_function(self.PREFIX + name):
            yield

    def output(self, name: str, out) -> None:
        """What span ``name`` returned: its tensors' distinct storages are not counted as held."""
        storages = {}
        todo = [out]
        while todo:
            t = todo.pop()
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
            elif isinstance(t, (tuple, list)):
                todo.extend(t)
            elif isinstance(t, dict):
                todo.extend(t.values())
        self.outputs[name] = self.outputs.get(name, 0) + sum(storages.values())

    def held(self) -> dict[str, int]:
        """Span name -> bytes allocated inside it and held at its end, less its output (after ``recording``)."""
        return {name: net - self.outputs.get(name, 0) for name, net in self.net.items()}
