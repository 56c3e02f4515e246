"""The resolved precision plan as text (start-up log, ``precision_plan.txt``) and as JSON data.

Layers whose names differ only in the transformer block index and whose plans (and modules) are identical
collapse to one row group: ``layers.[0-5].attention.wqkv``. The backend column is ``plan.backends.gemm_backend``:
the same answer lbt-doctor and the benchmarks give. Under the table, one line per reason a group of layers does
not run torchao's kernel (``plan.backends.fallback_reason``, the answer lbt-doctor's fallback rows give).
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

from low_bits_training.config.quantize import TorchaoOptions
from low_bits_training.nn import GEMMS, ROLES, LinearPlan
from low_bits_training.nn.hardware import Hardware
from low_bits_training.plan.backends import fallback_reason, gemm_backend

_BLOCK = re.compile(r"^layers\.(\d+)\.")


def _ranges(ids: list[int]) -> str:
    out, start = [], None
    for i, v in enumerate(ids):
        start = v if start is None else start
        if i + 1 == len(ids) or ids[i + 1] != v + 1:
            out.append(str(v) if start == v else f"{start}-{v}")
            start = None
    return ",".join(out)


def collapse(plans: dict[str, LinearPlan], modules: dict[str, str] | None = None) -> list[tuple[str, tuple]]:
    """``(label, (plan, module))`` rows, one per group of layers that differ only in block index, in model
    order (``module`` is "" without ``modules``)."""
    modules = modules or {}
    groups: dict[tuple, list[int]] = defaultdict(list)
    order: list[tuple] = []
    for fqn, plan in plans.items():
        m = _BLOCK.match(fqn)
        key = (_BLOCK.sub("layers.{}.", fqn) if m else fqn, (plan, modules.get(fqn, "")))
        if key not in groups:
            order.append(key)
        groups[key].append(int(m.group(1)) if m else -1)
    return [(name.replace("{}", f"[{_ranges(groups[(name, k)])}]"), k) for name, k in order]


def _cells(plan: LinearPlan) -> list[tuple[str, str, str]]:
    if all(b == "torchtitan" for b in plan.backends):
        return [("*", "the base's torchtitan converter", "torchtitan")]
    if plan.is_high_precision:
        return [("*", "high", "high")]
    return [
        (r.name, "high" if s is None else s.short(), gemm_backend(plan, r.gemm))
        for r, s in zip(ROLES, plan.specs, strict=True)
    ]


def format_plan(plans: dict[str, LinearPlan], modules: dict[str, str] | None = None) -> str:
    """Aligned text table: layers (grouped by identical plans), module, role, spec (or ``high``), backend.

    Args:
        plans: FQN -> resolved plan (``titan.targets.linear.current_plans``).
        modules: FQN -> what the layer builds (``QuantLinear``, ``torchao Float8Linear (rowwise)``, ...).
    """
    rows = [("layers", "module", "role", "spec", "backend")]
    by_key: dict[tuple, list[str]] = {}
    for label, key in collapse(plans, modules):
        by_key.setdefault(key, []).append(label)
    for (plan, module), labels in by_key.items():
        cells = _cells(plan)
        for i in range(max(len(labels), len(cells))):
            layer = labels[i] if i < len(labels) else ""
            rows.append((layer, module if i == 0 else "", *(cells[i] if i < len(cells) else ("",) * 3)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def plan_to_json(plans: dict[str, LinearPlan], modules: dict[str, str] | None = None) -> dict:
    """FQN -> {"module", "specs": {role: QuantSpec fields or None}, "backends": {gemm: gemm_backend}}."""
    return {
        fqn: {
            "module": (modules or {}).get(fqn, ""),
            "specs": {
                r.name: (None if s is None else dataclasses.asdict(s))
                for r, s in zip(ROLES, p.specs, strict=True)
            },
            "backends": {g: gemm_backend(p, g) for g in GEMMS},
        }
        for fqn, p in plans.items()
    }


def fallbacks(
    plans: dict[str, LinearPlan],
    shapes: dict,
    hw: Hardware,
    setting: str,
    opts: TorchaoOptions | None = None,
) -> list[tuple[str, list[str]]]:
    """Why layers do not run torchao's kernel on ``hw``: ``(fallback_reason, layer groups)`` per distinct
    reason, in model order; layers a base's torchtitan converter swapped are not the plan's and are left out.

    Args:
        plans: FQN -> resolved plan.
        shapes: FQN -> ``plan.resolve.LayerShape`` of the plan's entries.
        hw: the hardware judged on.
        setting: ``[quantize] backend``.
        opts: ``[quantize.torchao]``.
    """
    reasons = {}
    for fqn, plan in plans.items():
        if fqn in shapes and not all(b == "torchtitan" for b in plan.backends):
            why = fallback_reason(plan, shapes[fqn], hw, setting, opts)
            if why is not None:
                reasons[fqn] = why
    grouped: dict[str, list[str]] = {}
    for label, (_, why) in collapse(dict.fromkeys(reasons, LinearPlan()), reasons):
        grouped.setdefault(why, []).append(label)
    return list(grouped.items())


def format_fallbacks(rows: list[tuple[str, list[str]]], hw: Hardware, setting: str) -> str:
    """``fallbacks`` as the lines under the plan table ("" when every layer runs what it asked for)."""
    if not rows:
        return ""
    head = f"not on torchao's kernel (on {hw}, backend = {setting!r}):\n"
    return head + "".join(f"  {', '.join(labels)}: {why}\n" for why, labels in rows)
