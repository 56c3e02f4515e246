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

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count
from torchtitan.tools.logging import logger

from low_bits_training.config.profiling import ProfilingConfig
from low_bits_training.titan.platform.compat import memory_categories, profiler_running
from low_bits_training.titan.platform.ranks import rank

FLOPS_DIR = "profiling/flops"
TIMELINE_DIR = "profiling/memory_timeline"


def _path(folder: str, sub: str, step: int, ext: str) -> str:
    d = os.path.join(folder, sub)
    os.makedirs(d, exist_ok=True)
    return os.path.join(d, f"step_{step}_rank{rank()}.{ext}")


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


def _sdpa_cpu(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)


def _sdpa_cpu_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out, query, key, value)


# FlopCounterMode counts the CUDA attention kernels and FlexAttention but not SDPA's CPU kernel, which the
# CPU attention (titan/platform/cpu.py, adapter 2) and any CPU SDPA run: without these the table leaves
# attention out.
ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward,
}


@contextlib.contextmanager
def flop_table(folder: str, step: int, depth: int) -> Iterator[None]:
    """Count the FLOPs of the enclosed code per module; write the table and per-module totals.

    Args:
        folder: run folder.
        step: step number for the file names.
        depth: module depth of the text table.
    """
    mode = FlopCounterMode(display=False, depth=depth, custom_mapping=ATTENTION_FLOPS)
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


def timeline_html(times_us: list[int], sizes: list[list[int]], title: str, path: str) -> None:
    """A stacked plot of memory by category over time, embedded in an HTML page titled ``title``.

    Args:
        times_us: timestamps (microseconds).
        sizes: per timestamp, bytes per category (``[0, *memory_categories()]`` order, as torch writes them).
        title: the page and plot title (names the device: torch's own export says "GPU" on every device).
        path: the ``.html`` file to write.
    """
    import base64
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    t = (np.asarray(times_us, dtype=float) - min(times_us)) / 1e3  # ms from the first event
    stacked = np.cumsum(np.asarray(sizes, dtype=float), axis=1) / 2**30  # (T, 1 + categories), GiB
    fig, ax = plt.subplots(figsize=(14, 7), dpi=80)
    for i, name in enumerate(memory_categories()):
        ax.fill_between(t, stacked[:, i], stacked[:, i + 1], alpha=0.7, label=name)
    ax.set(xlabel="time (ms)", ylabel="memory (GiB)", title=title)
    ax.legend(loc="upper left")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    png = base64.b64encode(buf.getvalue()).decode()
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"<html><head><meta charset='utf-8'><title>{title}</title></head><body>")
        f.write(f"<img alt='{title}' src='data:image/png;base64,{png}'></body></html>\n")


@contextlib.contextmanager
def memory_timeline(folder: str, step: int) -> Iterator[None]:
    """Record the enclosed code's allocations and export the memory timeline (HTML plot and JSON).

    Args:
        folder: run folder.
        step: step number for the file names.
    """
    if profiler_running():  # torchtitan's [profiler] window covers this step
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
    data_path = _path(folder, TIMELINE_DIR, step, "json")
    prof.export_memory_timeline(data_path, device=dev)
    with open(data_path) as f:
        times, sizes = json.load(f)
    peak = max((sum(s) for s in sizes), default=0) / 2**30
    title = f"{dev.split(':')[0].upper()} memory timeline, step {step}, rank {rank()} (peak {peak:.2f} GiB)"
    if times:
        timeline_html(times, sizes, title, _path(folder, TIMELINE_DIR, step, "html"))
    logger.info(f"Memory timeline of step {step} written to {TIMELINE_DIR}")


STEP_SPAN = "train_step {step}"
"""The span each training step gets in a trace (torch's own ``ProfilerStep#N`` counts profiler steps,
which torchtitan starts one step off: ``ProfilerStep#N`` covers training step N+1)."""


def step_context(config: ProfilingConfig, folder: str, step: int) -> contextlib.ExitStack:
    """The profiling extras that apply to ``step``, and the step's span while a profiler records."""
    stack = contextlib.ExitStack()
    if profiler_running():
        stack.enter_context(torch.profiler.record_function(STEP_SPAN.format(step=step)))
    if config.memory_timeline_step == step:
        stack.enter_context(memory_timeline(folder, step))
    if config.flop_table_step == step:
        stack.enter_context(flop_table(folder, step, config.flop_table_depth))
    return stack
