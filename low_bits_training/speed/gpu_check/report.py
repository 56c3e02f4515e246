"""The GPU check's report: one markdown file (the machine, each level's time, one table per recipe, one row
per item) and one JSON file with every row and its numbers. Standard library only."""

from __future__ import annotations

import json
from pathlib import Path

from .catalog import LEVELS, RECIPES

COLUMNS = ("backends", "eager x bf16", "compiled x bf16", "model x bf16", "exactness", "CUDA graph")
"""The per-recipe table's columns; a row fills one with its ``summary`` dict (column -> cell)."""


def recipe_table(rows: list[dict]) -> list[str]:
    """One line per recipe of ``catalog.RECIPES``: what each item said about it ("-": nothing ran)."""
    cells: dict[str, dict[str, list[str]]] = {r: {c: [] for c in COLUMNS} for r in RECIPES}
    for row in rows:
        if row.get("recipe") in cells:
            for col, text in row.get("summary", {}).items():
                cells[row["recipe"]][col].append(str(text))
    lines = ["| recipe | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for recipe, cols in cells.items():
        lines.append(f"| {recipe} | " + " | ".join("; ".join(cols[c]) or "-" for c in COLUMNS) + " |")
    return lines


def item_table(rows: list[dict]) -> list[str]:
    """One line per row: level, item, status, seconds, detail."""
    lines = ["| level | item | status | s | detail |", "|---|---|---|---|---|"]
    for r in rows:
        name = (
            r["item"]
            + (f" {r['recipe']}" if r.get("recipe") else "")
            + (f" {r['case']}" if r.get("case") else "")
        )
        lines.append(
            f"| {r.get('level', '')} | {name} | {r['status']} | {r.get('seconds', '')} | {r.get('detail', '')} |"
        )
    return lines


def markdown(env: dict, budget_s: int, times: dict[int, float], rows: list[dict]) -> str:
    """The whole report as markdown."""
    head = [f"# GPU check: {env.get('device') or 'no CUDA device (CPU build)'}",
            f"torch {env.get('torch')}, torchao {env.get('torchao')}, torchtitan {env.get('torchtitan')}, "
            f"python {env.get('python')}, capability {env.get('capability')}; budget {budget_s} s", ""]  # fmt: skip
    names = {lv.number: lv.name for lv in LEVELS}
    head += [f"- level {n} ({names[n]}): {s:.1f} s" for n, s in times.items()]
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "fail", "skip", "info")}
    head += ["", "rows: " + ", ".join(f"{n} {s}" for s, n in counts.items()), ""]
    return (
        "\n".join([*head, "## Per recipe", "", *recipe_table(rows), "", "## Items", "", *item_table(rows)])
        + "\n"
    )


def write(out: Path, env: dict, budget_s: int, times: dict[int, float], rows: list[dict]) -> str:
    """Write ``gpu_check.md`` and ``gpu_check.json`` to ``out``; returns the markdown."""
    text = markdown(env, budget_s, times, rows)
    (out / "gpu_check.md").write_text(text)
    data = {"environment": env, "budget_s": budget_s, "level_seconds": times, "results": rows}
    (out / "gpu_check.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    return text
