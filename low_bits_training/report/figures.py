"""The report's pictures (matplotlib, Agg): curves of several runs, numerics heatmaps of one run."""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from low_bits_training.nn.roles import ROLE_NAMES  # noqa: E402

from .runs import LOSS, TPS, RunData, heat  # noqa: E402

HEAT_METRICS = {
    "underflow": ("fraction of nonzero values flushed to zero", "magma"),
    "saturation": ("fraction of values beyond the format max", "magma"),
    "sqnr_db": ("SQNR (dB) of the quantized operand", "viridis"),
}


def curves(runs: list[RunData], key: str, ylabel: str, path: Path) -> Path | None:
    """One line per run of metric ``key`` against step; None when no run has it."""
    fig, ax = plt.subplots(figsize=(7, 4))
    drawn = False
    for run in runs:
        steps, vals = run.series(key)
        if steps:
            ax.plot(steps, vals, marker="." if len(steps) < 30 else None, label=run.name)
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    ax.set(xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def loss_plot(runs: list[RunData], out: Path) -> Path | None:
    return curves(runs, LOSS, "loss (global average)", out / "loss.png")


def throughput_plot(runs: list[RunData], out: Path) -> Path | None:
    return curves(runs, TPS, "tokens / s / device", out / "throughput.png")


def memory_plot(runs: list[RunData], out: Path) -> Path | None:
    key = next((k for r in runs if (k := r.memory_key())), None)
    return curves(runs, key, key.split("/")[-1], out / "memory.png") if key else None


def heatmap(run: RunData, metric: str, out: Path) -> Path | None:
    """Six panels (one per role) of layer x step for one metric; None when the run has no statistics."""
    if not run.numerics:
        return None
    title, cmap = HEAT_METRICS[metric]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), squeeze=False)
    for ax, role in zip(axes.flat, ROLE_NAMES, strict=True):
        layers, steps, grid = heat(run, metric, role)
        ax.set_title(role, fontsize=10)
        if not layers:
            ax.set_axis_off()
            continue
        clean = [[v if math.isfinite(v) else math.nan for v in row] for row in grid]
        im = ax.imshow(clean, aspect="auto", cmap=cmap, interpolation="nearest")
        ax.set_yticks(range(len(layers)), layers, fontsize=5)
        ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7)
        ax.set_xlabel("step", fontsize=8)
        fig.colorbar(im, ax=ax)
    fig.suptitle(f"{run.name}: {title}")
    fig.tight_layout()
    path = out / f"{run.name}_{metric}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


TRIGGER_COLORS = {
    "nonfinite": "tab:red",
    "spike": "tab:purple",
    "statistic": "tab:orange",
    "demotion": "tab:green",
}


def _kind(trigger: str) -> str:
    if trigger in ("nonfinite", "clean"):
        return "demotion" if trigger == "clean" else trigger
    return "spike" if trigger.endswith("_spike") else "statistic"


def autopilot_timeline(run: RunData, out: Path) -> Path | None:
    """The run's loss with the autopilot's decisions over it: a line at each decision's first step under the
    new plan (red: a NaN / Inf, orange: a statistic, purple: a spike's rollback, with a cross at the step
    that spiked, green: a demotion), labelled with the layer, role and new format. None when the run decided nothing."""
    if not run.decisions:
        return None
    steps, losses = run.series(LOSS)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    if steps:
        ax.plot(steps, losses, color="tab:blue", lw=1.2, label="loss")
    top = max((v for v in losses if math.isfinite(v)), default=1.0)
    seen_kinds = set()
    for d in run.decisions:
        kind = _kind(str(d.get("trigger", "")))
        color = TRIGGER_COLORS[kind]
        ax.axvline(d["step"], color=color, lw=1, alpha=0.7, label=None if kind in seen_kinds else kind)
        seen_kinds.add(kind)
        what = f"{d['layer']} {d['role']} -> {d['after']}" if d.get("layer") else "rollback, same plan"
        ax.annotate(what, (d["step"], top), rotation=90, fontsize=6, va="top", ha="right", color=color)
        if d.get("seen"):
            ax.plot([d["seen"]], [top], marker="x", color=color, ms=7)
    ax.set(xlabel="step", ylabel="loss (global average)", title=f"autopilot decisions: {run.name}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    path = out / f"autopilot_{run.name}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
