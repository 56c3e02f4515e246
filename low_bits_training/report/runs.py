"""Reading run folders: ``metrics.jsonl`` (loss, throughput, memory) and ``numerics.jsonl`` (statistics)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOSS = "loss_metrics/global_avg_loss"
TPS = "throughput(tps)"
MEMORY = ("memory/max_reserved(GiB)", "memory/max_active(GiB)")


def _number(v: Any) -> float:
    return float(v) if isinstance(v, (int, float, str)) else math.nan


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class RunData:
    """One run folder's series."""

    name: str
    folder: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """Rows of metrics.jsonl merged by step, in step order."""
    numerics: list[dict[str, Any]] = field(default_factory=list)
    """Rows of numerics.jsonl: one per (step, layer, role)."""

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` of one metric (steps that do not have it are left out)."""
        pts = [(r["step"], _number(r[key])) for r in self.metrics if key in r]
        return [p[0] for p in pts], [p[1] for p in pts]

    def memory_key(self) -> str | None:
        return next((k for k in MEMORY if any(k in r for r in self.metrics)), None)

    def summary(self) -> dict[str, Any]:
        """The numbers table row: steps, final loss, mean throughput, peak memory, worst numerics."""
        _, loss = self.series(LOSS)
        _, tps = self.series(TPS)
        mem_key = self.memory_key()
        mem = self.series(mem_key)[1] if mem_key else []
        num = {k: [_number(r[k]) for r in self.numerics] for k in ("underflow", "saturation", "sqnr_db")}
        return {
            "run": self.name,
            "steps": max((r["step"] for r in self.metrics), default=0),
            "final_loss": loss[-1] if loss else math.nan,
            "mean_tps": sum(tps[1:]) / len(tps[1:]) if len(tps) > 1 else (tps[0] if tps else math.nan),
            "peak_memory_gib": max(mem) if mem else math.nan,
            "max_underflow": max(num["underflow"], default=math.nan),
            "max_saturation": max(num["saturation"], default=math.nan),
            "min_sqnr_db": min(num["sqnr_db"], default=math.nan),
        }


def load_run(folder: str | Path) -> RunData:
    """Read a run folder.

    Raises:
        FileNotFoundError: the folder has neither metrics.jsonl nor numerics.jsonl.
    """
    folder = Path(folder)
    raw = _read_jsonl(folder / "metrics.jsonl")
    numerics = _read_jsonl(folder / "numerics.jsonl")
    if not raw and not numerics:
        raise FileNotFoundError(f"{folder}: no metrics.jsonl or numerics.jsonl (is it a run folder?)")
    by_step: dict[int, dict[str, Any]] = {}
    for row in raw:
        by_step.setdefault(row["step"], {}).update(row)
    return RunData(folder.resolve().name, folder, [by_step[s] for s in sorted(by_step)], numerics)


def heat(run: RunData, metric: str, role: str) -> tuple[list[str], list[int], list[list[float]]]:
    """A (layer x step) grid of one numerics metric for one role; NaN where a cell has no row.

    Returns:
        ``(layers in first-seen order, steps, grid[layer][step])``.
    """
    rows = [r for r in run.numerics if r["role"] == role]
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    steps = sorted({r["step"] for r in rows})
    li, si = {n: i for i, n in enumerate(layers)}, {s: i for i, s in enumerate(steps)}
    grid = [[math.nan] * len(steps) for _ in layers]
    for r in rows:
        grid[li[r["layer"]]][si[r["step"]]] = _number(r[metric])
    return layers, steps, grid
