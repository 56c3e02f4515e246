"""Peak memory that torch's allocator hands out while a function runs (what an optimizer step costs).

On CUDA this is ``torch.cuda.max_memory_allocated``. The CPU allocator keeps no statistics, but it reports every
allocation and free to the profiler (``profile_memory=True``); the running sum of those events gives the
peak. Python objects and compiler work (torch.compile's first call) are not tensor allocations and are not
counted: the process's peak RSS shows those (benchmarks/bench_optim.py reports both).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


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
