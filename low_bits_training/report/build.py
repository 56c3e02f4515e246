"""Build the report: PNG files and ``report.html`` (images embedded as base64, a numbers table)."""

from __future__ import annotations

import base64
import html
import math
from pathlib import Path
from typing import Any

from . import figures
from .runs import RunData, flop_shares, load_run, saved_rows, state_rows, whatif_summary

COLUMNS = (
    ("run", "run"),
    ("final_step", "final step"),  # the step the final loss is from / training.steps (runs.step_cell)
    ("final_loss", "final loss"),
    ("median_tps", "median tok/s/proc"),
    ("peak_memory_gib", "peak memory (GiB)"),
    ("max_underflow", "max underflow"),
    ("max_saturation", "max saturation"),
    ("min_sqnr_db", "min SQNR (dB)"),
)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.4g}"
    return html.escape(str(v))


def unique_names(runs: list[RunData]) -> None:
    """Runs whose folders share a name are told apart by their parent folder (``a/run``, ``b/run``)."""
    names = [r.name for r in runs]
    for r in runs:
        if names.count(r.name) > 1:
            r.name = f"{r.folder.resolve().parent.name}_{r.name}"


WHATIF_COLUMNS = (
    ("whatif", "alternative"),
    ("role", "role"),
    ("spec", "spec"),
    ("layers", "layers"),
    ("max_underflow", "max underflow"),
    ("max_saturation", "max saturation"),
    ("min_sqnr_db", "min SQNR (dB)"),
    ("worst_layer", "lowest-SQNR layer"),
)


STATE_COLUMNS = (
    ("state", "state"),
    ("format", "format"),
    ("planned", "B/param computed"),
    ("measured", "B/param measured"),
)
PEAK_COLUMNS = (("what", "rank 0"), ("gib", "GiB"))
SAVED_COLUMNS = (
    ("module", "module"),
    ("stored", "stored (hooks)"),
    ("allocator", "held (allocator)"),
    ("as_made", "as made"),
)


DECISION_COLUMNS = (
    ("step", "step"),
    ("layer", "layer"),
    ("role", "role"),
    ("trigger", "trigger"),
    ("value", "figure"),
    ("before", "before"),
    ("after", "after"),
    ("seen", "spike at"),
)


def _table(rows: list[dict[str, Any]], columns=COLUMNS, table_id: str = "numbers") -> str:
    head = "".join(f"<th>{label}</th>" for _, label in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{_fmt(r.get(k, ''))}</td>" for k, _ in columns) + "</tr>" for r in rows
    )
    return f'<table id="{table_id}"><tr>{head}</tr>{body}</table>'


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<figure><img alt="{path.stem}" src="data:image/png;base64,{data}"><figcaption>{path.name}</figcaption></figure>'


def peak_rows(run: RunData) -> list[dict[str, Any]]:
    """The byte report's peak memory of rank 0: each part the plan names at its peak, then the planned and the
    measured peak (GiB; empty: no peak_memory.json)."""
    if not run.peak:
        return []
    plan, measured = run.peak.get("planned") or {}, run.peak.get("measured") or {}
    rows = [{"what": part, "gib": round(b / 2**30, 3)} for part, b in (plan.get("parts") or {}).items()]
    if plan:
        rows.append({"what": "planned peak, a later step", "gib": round(plan["later_steps"] / 2**30, 3)})
    if measured:
        rows.append(
            {"what": f"measured peak, step {measured['step']}", "gib": round(measured["peak"] / 2**30, 3)}
        )
    return rows


def build_report(folders: list[str | Path], out: str | Path) -> Path:
    """Read the run folders, draw the figures into ``out`` and write ``out/report.html``.

    Args:
        folders: run folders (``<dump_folder>`` of each training run).
        out: output folder (created).

    Returns:
        The path of ``report.html``.

    Raises:
        FileNotFoundError: a folder holds neither metrics.jsonl nor numerics.jsonl.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [load_run(f) for f in folders]
    unique_names(runs)
    shared = [
        figures.loss_plot(runs, out),
        figures.throughput_plot(runs, out),
        figures.memory_plot(runs, out),
    ]
    per_run = {r.name: [figures.heatmap(r, m, out) for m in figures.HEAT_METRICS] for r in runs}
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>low-bits-training report</title>",
        "<style>body{font-family:sans-serif;margin:2em}td,th{border:1px solid #ccc;padding:4px 8px}"
        "table{border-collapse:collapse}img{max-width:100%}</style></head><body>",
        "<h1>low-bits-training report</h1>",
        "<p>Runs: "
        + ", ".join(f"<code>{html.escape(r.name)}</code> ({html.escape(str(r.folder))})" for r in runs),
        "</p>",
        _table([r.summary() for r in runs]),
        "<h2>Training</h2>",
        *(_img(p) for p in shared if p),
    ]
    for run in runs:
        paths = per_run[run.name]
        if any(paths):
            parts += [f"<h2>Numerics: {html.escape(run.name)}</h2>", *(_img(p) for p in paths if p)]
        if run.decisions:  # [quantize.autopilot]: every promotion and rollback of the run
            down = sum(d.get("trigger") == "clean" for d in run.decisions)
            promoted = sum(bool(d.get("layer")) for d in run.decisions) - down
            back = sum(bool(d.get("seen")) for d in run.decisions)
            counts = f"{promoted} promotions, {back} rollbacks" + (f", {down} demotions" if down else "")
            parts += [
                f"<h2>Autopilot: {html.escape(run.name)} ({counts})</h2>",
                _img(figures.autopilot_timeline(run, out)),
                _table(run.decisions, DECISION_COLUMNS, "autopilot"),
            ]
        shares = flop_shares(run)
        if len(shares) > 1 or run.decisions:  # a run whose GEMMs ran in more than one format
            rows = [{"format": r["format"], "share": f"{100 * r['share']:.1f}%"} for r in shares]
            parts += [
                f"<h2>GEMM FLOPs by operand formats: {html.escape(run.name)} (every plan target, steps 1-"
                f"{run.last_step})</h2>",
                _table(rows, (("format", "operand formats"), ("share", "share of FLOPs")), "flops"),
            ]
        states, saves = state_rows(run), saved_rows(run)
        if states:  # state_bytes.json: what the run holds
            parts += [
                f"<h2>Memory: {html.escape(run.name)} (training state, all ranks)</h2>",
                _table(states, STATE_COLUMNS, "state_bytes"),
            ]
        peak = peak_rows(run)
        if peak:  # peak_memory.json: the launcher's plan beside the allocator's peak
            parts += [
                f"<h2>Peak memory: {html.escape(run.name)}</h2>",
                _table(peak, PEAK_COLUMNS, "peak_memory"),
            ]
        if saves:
            parts += [
                f"<h2>Saved for the backward: {html.escape(run.name)} (bytes per token, rank 0)</h2>",
                _table(saves, SAVED_COLUMNS, "saved_bytes"),
            ]
        alt = whatif_summary(run)
        if alt:  # [numerics] whatif: other formats measured on the same live tensors
            parts += [
                f"<h2>What-if formats: {html.escape(run.name)} (step {alt[0]['step']}, worst layer per role)</h2>",
                _table(alt, WHATIF_COLUMNS, "whatif"),
            ]
    parts.append("</body></html>")
    page = out / "report.html"
    page.write_text("\n".join(parts))
    return page
