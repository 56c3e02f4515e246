"""The one reader of run folders, for ``lbt-report``, ``lbt-sweep`` and ``lbt-scaling``: ``metrics.jsonl``
(loss, throughput, memory), ``numerics.jsonl`` (statistics), ``autopilot.jsonl`` (the autopilot's
decisions) and ``state_bytes.json`` (the byte report), and the numbers every table shows.

The numbers every table (sweep, scaling, report) shows come from here:

- the **final loss** is the loss of the run's last logged step, and the metrics writer always logs a run's
  last step (``titan/runtime/metrics.py``), whatever ``metrics.log_freq`` is; ``RunData.last_step`` says which
  step that is and ``RunData.total_steps`` what the run was asked for (a run cut short shows fewer);
- **throughput** is the **median** tokens/s per process over the logged training rows, leaving out each
  process start's first row (``runfolder.FIRST_LOG``: its window holds warm-up, compilation and any checkpoint
  load). The median shrugs off steps slowed by other jobs on a shared machine. A run whose only row is a
  start's first row has no measured throughput (NaN, shown as ``-``).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from low_bits_training.config.autopilot import AUTOPILOT_FILE
from low_bits_training.nn.roles import GEMMS, ROLE_NAMES
from low_bits_training.numerics.records import NUMERICS_FILE
from low_bits_training.run.folder import (
    FIRST_LOG,
    GEMM_SIZES_JSON,
    LOSS,
    MEMORY,
    METRICS_FILE,
    PEAK_JSON,
    PLAN_JSON,
    SCHEDULE_JSON,
    STATE_BYTES_JSON,
    TPS,
    read_jsonl,
    read_metrics,
    read_total_steps,
)


def _number(v: Any) -> float:
    try:
        return float(v)  # "nan" / "inf" strings stand for JSON's missing non-finite numbers
    except (TypeError, ValueError):
        return math.nan


@dataclass
class RunData:
    """One run folder's series."""

    name: str
    folder: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """Rows of metrics.jsonl merged by step, in step order."""
    numerics: list[dict[str, Any]] = field(default_factory=list)
    """Rows of numerics.jsonl of the plan's own casts: one per (step, layer, role)."""
    whatif: list[dict[str, Any]] = field(default_factory=list)
    """Rows of numerics.jsonl of what-if formats (``[numerics] whatif``): one per (step, layer, role, name)."""
    decisions: list[dict[str, Any]] = field(default_factory=list)
    """Rows of autopilot.jsonl (``[quantize.autopilot]``): one per promotion, in step order."""
    budget: dict[str, Any] | None = None
    """state_bytes.json (``titan.runtime.budget``): training-state bytes per parameter, computed and
    measured, and ``[[quantize.saved]]`` bytes per token (None: not written)."""
    peak: dict[str, Any] | None = None
    """peak_memory.json (``titan.runtime.peak_log``): rank 0's planned peak and its parts, and the peak the
    allocator measured (None: not written)."""

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """``(steps, values)`` of one metric (steps that do not have it are left out)."""
        pts = [(r["step"], _number(r[key])) for r in self.metrics if key in r]
        return [p[0] for p in pts], [p[1] for p in pts]

    def memory_key(self) -> str | None:
        """The peak-memory metric this run logged (``MEMORY`` order), or None."""
        return next((k for k in MEMORY if any(k in r for r in self.metrics)), None)

    @property
    def losses(self) -> dict[int, float]:
        """Step -> training loss."""
        return dict(zip(*self.series(LOSS), strict=True))

    @property
    def last_step(self) -> int:
        """The last step with a logged loss (0: none): the run's last step once it finished."""
        return max(self.losses, default=0)

    @property
    def total_steps(self) -> int | None:
        """``training.steps`` of the run (its ``config.json``; None: not written)."""
        return read_total_steps(self.folder)

    @property
    def final_loss(self) -> float:
        """The loss at ``last_step`` (NaN: none)."""
        return self.losses.get(self.last_step, math.nan)

    @property
    def tps(self) -> float:
        """Tokens/s per process: the median over the training rows that are not a start's first (NaN: none)."""
        rows = [r for r in self.metrics if TPS in r]
        if any(FIRST_LOG in r for r in rows):
            steady = [r for r in rows if r.get(FIRST_LOG) is False]
        else:  # written before FIRST_LOG: one start, its first row is the warm-up
            steady = rows[1:]
        values = [_number(r[TPS]) for r in steady]
        return statistics.median(values) if values else math.nan

    @property
    def peak_memory_gib(self) -> float:
        """Peak memory over the run (GiB; NaN: not logged)."""
        key = self.memory_key()
        return max(self.series(key)[1], default=math.nan) if key else math.nan

    def summary(self) -> dict[str, Any]:
        """The numbers table row: the final loss and its step, median throughput, peak memory, worst
        numerics."""
        num = {k: [_number(r[k]) for r in self.numerics] for k in ("underflow", "saturation", "sqnr_db")}
        return {
            "run": self.name,
            "final_step": step_cell([self.last_step], self.total_steps),
            "final_loss": self.final_loss,
            "median_tps": self.tps,
            "peak_memory_gib": self.peak_memory_gib,
            "max_underflow": max(num["underflow"], default=math.nan),
            "max_saturation": max(num["saturation"], default=math.nan),
            "min_sqnr_db": min(num["sqnr_db"], default=math.nan),
        }


def step_cell(last_steps: list[int], total: int | None) -> str:
    """Which step a final loss is from, as tables show it: ``12/12`` (last logged step / ``training.steps``),
    ``10-12/12`` over several runs, ``12`` when the total is unknown, ``-`` for no step."""
    done = sorted(s for s in last_steps if s > 0)
    if not done:
        return "-"
    steps = str(done[0]) if done[0] == done[-1] else f"{done[0]}-{done[-1]}"
    return steps if total is None else f"{steps}/{total}"


def has_metrics(folder: str | Path) -> bool:
    """True when ``folder`` holds a ``metrics.jsonl`` (the run logged at least its start)."""
    return (Path(folder) / METRICS_FILE).is_file()


def load_run(folder: str | Path) -> RunData:
    """Read a run folder.

    Raises:
        FileNotFoundError: the folder has neither metrics.jsonl nor numerics.jsonl.
    """
    folder = Path(folder)
    metrics = read_metrics(folder)
    numerics = read_jsonl(folder / NUMERICS_FILE)
    if not metrics and not numerics:
        raise FileNotFoundError(f"{folder}: no {METRICS_FILE} or {NUMERICS_FILE} (is it a run folder?)")
    own = [r for r in numerics if "whatif" not in r]
    alt = [r for r in numerics if "whatif" in r]
    decisions = read_jsonl(folder / AUTOPILOT_FILE)
    budget_file = folder / STATE_BYTES_JSON
    budget = json.loads(budget_file.read_text()) if budget_file.is_file() else None
    peak_file = folder / PEAK_JSON
    peak = json.loads(peak_file.read_text()) if peak_file.is_file() else None
    return RunData(folder.resolve().name, folder, metrics, own, alt, decisions, budget, peak)


def state_rows(run: RunData) -> list[dict[str, Any]]:
    """The byte report's training states: bytes per parameter computed from the config and measured on the
    live tensors, with the format (empty: no state_bytes.json)."""
    if not run.budget:
        return []
    planned, measured = run.budget.get("planned") or {}, run.budget.get("measured") or {}
    per_plan, per_live = planned.get("bytes_per_param", {}), measured.get("bytes_per_param", {})
    formats = planned.get("formats") or measured.get("formats") or {}
    return [
        {
            "state": state,
            "format": "; ".join(formats.get(state, [])),
            "planned": round(per_plan.get(state, math.nan), 3),
            "measured": round(per_live.get(state, math.nan), 3),
        }
        for state in [*dict.fromkeys([*per_plan, *per_live])]
    ]


def saved_rows(run: RunData) -> list[dict[str, Any]]:
    """The byte report's ``[[quantize.saved]]`` bytes per token per module, and their total: stored (the
    hooks), held (the allocator, on the step it measured) and as made (empty: no rules or no report)."""
    saved = (run.budget or {}).get("saved_bytes_per_token") or {}
    whole = {k: v for k, v in saved.items() if k != "modules"}
    rows = [{"module": m, **v} for m, v in (saved.get("modules") or {}).items()]
    rows += [{"module": "total", **whole}] if whole else []
    return [{k: (round(v) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]


def whatif_summary(run: RunData) -> list[dict[str, Any]]:
    """The what-if statistics of the last step that has them, per (alternative, role) over the layers: the
    worst underflow / saturation / SQNR and the layer with the lowest SQNR (which layers tolerate it)."""
    if not run.whatif:
        return []
    last = max(r["step"] for r in run.whatif)
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in run.whatif:
        if r["step"] == last:
            groups.setdefault((r["whatif"], r["role"]), []).append(r)
    out = []
    for (name, role), rows in groups.items():
        worst = min(rows, key=lambda r: _number(r["sqnr_db"]))
        out.append({
            "step": last, "whatif": name, "role": role, "spec": worst.get("spec", ""), "layers": len(rows),
            "max_underflow": max(_number(r["underflow"]) for r in rows),
            "max_saturation": max(_number(r["saturation"]) for r in rows),
            "min_sqnr_db": _number(worst["sqnr_db"]), "worst_layer": worst["layer"],
        })  # fmt: skip
    return out


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


def _gemm_label(specs: dict[str, Any], gemm: str, override: dict[str, str]) -> str:
    """``"e4m3 x e4m3"`` / ``"high"``: the element formats of one GEMM's two operands (``override``: role ->
    format an autopilot decision set)."""
    fmts = []
    for role in (r for r in ROLE_NAMES if r.startswith(gemm + ".")):
        spec = specs.get(role)
        fmts.append(override.get(role, spec["format"] if spec else "high"))
    return "high" if all(f == "high" for f in fmts) else " x ".join(fmts)


def flop_shares(run: RunData) -> list[dict[str, Any]]:
    """The share of the GEMM FLOPs of every plan target (linear layers, router gates, expert weights,
    attention products; forward, dgrad, wgrad of every step up to the last logged one) that ran in each pair
    of operand formats, from the run folder's plan files: ``gemm_sizes.json`` (``[in, out, copies]``: each
    GEMM of an entry does 2 x tokens x in x out x copies per step, copies being the query heads of an
    attention product or the experts a token is routed to; a run from before copies were written has
    ``[in, out]``, linear layers only), ``precision_schedule.json`` (phases; else
    ``precision_plan.json`` for every step) and ``autopilot.jsonl`` (a promotion holds from its step on).
    Empty when the folder has no sizes (a run from before they were written) or no step."""
    folder, last = Path(run.folder), run.last_step
    sizes_path = folder / GEMM_SIZES_JSON
    if last < 1 or not sizes_path.is_file():
        return []
    sizes = json.loads(sizes_path.read_text())
    if (folder / SCHEDULE_JSON).is_file():
        phases = [p for p in json.loads((folder / SCHEDULE_JSON).read_text()) if p["first_step"] >= 1]
    elif (folder / PLAN_JSON).is_file():
        phases = [{"first_step": 1, "plans": json.loads((folder / PLAN_JSON).read_text())}]
    else:
        return []
    phases.sort(key=lambda p: p["first_step"])
    promotions = [d for d in run.decisions if d.get("layer")]
    cuts = {1, last + 1} | {p["first_step"] for p in phases} | {int(d["step"]) for d in promotions}
    edges = sorted(c for c in cuts if 1 <= c <= last + 1)
    flops: dict[str, float] = {}
    for start, end in zip(edges, edges[1:], strict=False):
        plans = [p for p in phases if p["first_step"] <= start][-1]["plans"]
        now: dict[str, dict[str, str]] = {}
        for d in promotions:  # in the order taken: a later one on the same role wins
            if int(d["step"]) <= start:
                now.setdefault(d["layer"], {})[d["role"]] = str(d["after"]).split("/")[0]
        for fqn, (n_in, n_out, *copies) in sizes.items():
            specs = plans.get(fqn, {}).get("specs", {})
            for gemm in GEMMS:
                label = _gemm_label(specs, gemm, now.get(fqn, {}))
                flops[label] = flops.get(label, 0.0) + (end - start) * n_in * n_out * (copies or [1])[0]
    total = sum(flops.values())
    return (
        [{"format": k, "share": v / total} for k, v in sorted(flops.items(), key=lambda kv: -kv[1])]
        if total
        else []
    )
