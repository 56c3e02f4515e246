"""The sweep table of finished runs (read by ``report.runs``): markdown, CSV and a loss plot."""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from low_bits_training.report.runs import has_metrics, load_run, step_cell


@dataclass(frozen=True)
class RunStats:
    """One run's summary, as every table shows it, read by ``report.runs`` (the one run-folder reader, where
    "final" and throughput are defined)."""

    losses: dict[int, float]
    """Step -> loss."""
    tps: float
    """Tokens/s per process (``RunData.tps``: median, each start's first row left out; NaN: not measured)."""
    peak_gib: float
    """Peak memory (GiB; on CPU the process's peak RSS)."""
    final: float = math.nan
    """The loss at ``last_step`` (``RunData.final_loss``)."""
    last_step: int = 0
    """The step ``final`` is from (``RunData.last_step``)."""
    total_steps: int | None = None
    """``training.steps`` of the run (None: unknown)."""

    @property
    def best(self) -> float:
        return min(self.losses.values()) if self.losses else math.nan


def run_stats(folder: str | Path) -> RunStats | None:
    """The summary of a run folder, or None when it has no metrics."""
    if not has_metrics(folder):
        return None
    run = load_run(folder)
    return RunStats(run.losses, run.tps, run.peak_memory_gib, run.final_loss, run.last_step, run.total_steps)


def final_step(stats: list[RunStats]) -> str:
    """The "final step" cell of runs pooled in one row (``report.runs.step_cell``: ``12/12``, ``10-12/12``)."""
    totals = {s.total_steps for s in stats}
    return step_cell([s.last_step for s in stats], totals.pop() if len(totals) == 1 else None)


def mean_std(xs: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value, NaN for none)."""
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return math.nan, math.nan
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


@dataclass(frozen=True)
class Row:
    """One table row: a configuration, its seeds pooled."""

    label: str
    """The non-seed grid values (``recipe=fp8_rowwise``)."""
    nproc: int
    """Processes per node."""
    seeds: dict[object, RunStats | None]
    """Seed value -> that run's stats (None: failed or not finished)."""


def _fmt(m: float, s: float | None = None, digits: int = 4) -> str:
    if math.isnan(m):
        return "-"
    return f"{m:.{digits}f}" if s is None else f"{m:.{digits}f} ± {s:.{digits}f}"


def delta_to(row: Row, base: Row) -> tuple[float, float]:
    """Final-loss difference to ``base``, paired by seed where both have it (mean ± std over seeds)."""
    done = lambda r: {k: v.final for k, v in r.seeds.items() if v is not None}  # noqa: E731
    mine, theirs = done(row), done(base)
    paired = [mine[k] - theirs[k] for k in mine if k in theirs]
    if paired:
        return mean_std(paired)
    m, s = mean_std(list(mine.values()))
    return m - mean_std(list(theirs.values()))[0], s


HEADER = (
    "config",
    "nproc",
    "runs",
    "final step",
    "final loss",
    "best loss",
    "Δ final vs baseline",
    "tok/s/proc",
    "tok/s total",
    "peak GiB",
)


def table_rows(rows: list[Row], baseline: Row) -> list[tuple[str, ...]]:
    """The cells of the table (strings, ``-`` where there is no number)."""
    out = []
    for r in rows:
        done = [s for s in r.seeds.values() if s is not None]
        fin, best = mean_std([s.final for s in done]), mean_std([s.best for s in done])
        tps = mean_std([s.tps for s in done])[0]
        peak = max((s.peak_gib for s in done), default=math.nan)
        d = (0.0, 0.0) if r is baseline else delta_to(r, baseline)
        label = r.label + (" (baseline)" if r is baseline else "")
        out.append(
            (
                label,
                str(r.nproc),
                f"{len(done)}/{len(r.seeds)}",
                final_step(done),
                _fmt(*fin),
                _fmt(*best),
                _fmt(*d) if done else "-",
                _fmt(tps, digits=0),
                _fmt(tps * r.nproc, digits=0),
                _fmt(peak, digits=2),
            )
        )
    return out


def markdown(cells: list[tuple[str, ...]], header: tuple[str, ...] = HEADER) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells]) + "\n"


def write_csv(path: Path, cells: list[tuple[str, ...]], header: tuple[str, ...] = HEADER) -> None:
    """The same table as CSV (``±`` kept in the cell text)."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(cells)


def plot_losses(path: Path, curves: dict[str, dict[int, float]], title: str) -> None:
    """One PNG: a loss curve per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for label, losses in curves.items():
        steps = sorted(losses)
        ax.plot(steps, [losses[s] for s in steps], label=label, marker="." if len(steps) < 30 else None)
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.grid(alpha=0.3)
    if curves:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
