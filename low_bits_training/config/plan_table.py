"""The resolved precision plan as text (start-up log, ``precision_plan.txt``) and as JSON data.

Layers whose names differ only in the transformer block index and whose plans are identical collapse to one
row group: ``layers.[0-5].attention.wqkv``.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from low_bits_training.nn import GEMMS, ROLES, LinearPlan

_BLOCK = re.compile(r"^layers\.(\d+)\.")


def _ranges(ids: list[int]) -> str:
    out, start = [], None
    for i, v in enumerate(ids):
        start = v if start is None else start
        if i + 1 == len(ids) or ids[i + 1] != v + 1:
            out.append(str(v) if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)


def collapse(plans: dict[str, LinearPlan]) -> list[tuple[str, LinearPlan]]:
    """``(label, plan)`` rows, one per group of layers that differ only in block index, in model order."""
    groups: dict[tuple[str, LinearPlan], list[int]] = defaultdict(list)
    order: list[tuple[str, LinearPlan]] = []
    for fqn, plan in plans.items():
        m = _BLOCK.match(fqn)
        key = (_BLOCK.sub("layers.{}.", fqn) if m else fqn, plan)
        if key not in groups:
            order.append(key)
        groups[key].append(int(m.group(1)) if m else -1)
    return [(name.replace("{}", f"[{_ranges(groups[(name, p)])}]"), p) for name, p in order]


def _by_plan(plans: dict[str, LinearPlan]) -> list[tuple[list[str], LinearPlan]]:
    out: dict[LinearPlan, list[str]] = {}
    for label, plan in collapse(plans):
        out.setdefault(plan, []).append(label)
    return [(labels, plan) for plan, labels in out.items()]


def format_plan(plans: dict[str, LinearPlan]) -> str:
    """Aligned text table: layers (grouped by identical plans), role, spec (or ``high``), GEMM backend."""
    rows = [("layers", "role", "spec", "backend")]
    for labels, plan in _by_plan(plans):
        cells = (
            [("*", "high", "-")]
            if plan.is_high_precision
            else [
                (r.name, "high" if s is None else s.short(), plan.backend(r.gemm))
                for r, s in zip(ROLES, plan.specs, strict=True)
            ]
        )
        for i in range(max(len(labels), len(cells))):
            rows.append((labels[i] if i < len(labels) else "", *(cells[i] if i < len(cells) else ("",) * 3)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def plan_to_json(plans: dict[str, LinearPlan]) -> dict:
    """FQN -> {"specs": {role: QuantSpec fields or None}, "backends": {gemm: backend}} (plain data)."""
    return {
        fqn: {
            "specs": {
                r.name: (None if s is None else dataclasses.asdict(s))
                for r, s in zip(ROLES, p.specs, strict=True)
            },
            "backends": dict(zip(GEMMS, p.backends, strict=True)),
        }
        for fqn, p in plans.items()
    }
