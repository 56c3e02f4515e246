"""Markdown tables of speed predictions (``lbt-speed``): a plan's step, its targets grouped by layer name,
the published-figures comparison."""

from __future__ import annotations

import re

from .predict import Prediction, TargetRow
from .published import SOURCES, Published


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def summary(pred: Prediction) -> str:
    """The step in a few lines: speedup, ceiling, where the time goes, which dtypes run the FLOPs."""
    ms = 1e3
    shares = ", ".join(f"{d} {s:.0%}" for d, s in pred.dtype_share().items())
    return "\n".join(
        [
            f"{pred.gpu}: step speedup over bf16 {pred.speedup:.2f}x (Amdahl ceiling, casts free: "
            f"{pred.ceiling:.2f}x; GEMMs + casts alone: {pred.gemm_speedup:.2f}x)",
            f"  bf16 step {pred.bf16_step_seconds * ms:.1f} ms = GEMMs {pred.bf16_gemm_seconds * ms:.1f} + "
            f"other {pred.other_seconds * ms:.1f}; plan: GEMMs {pred.gemm_seconds * ms:.1f} + casts "
            f"{pred.cast_seconds * ms:.1f} + other {pred.other_seconds * ms:.1f}",
            f"  GEMM FLOPs by dtype: {shares}",
        ]
    )


def _group_key(row: TargetRow) -> tuple:
    t = row.target
    name = re.sub(r"^layers\.\d+\.", "layers.*.", t.fqn)
    return (name, t.kind, t.in_features, t.out_features, t.tokens, tuple(g.dtype for g in row.gemms))


def layer_table(pred: Prediction) -> str:
    """Targets grouped by name with the block index starred: shape, dtype per GEMM, times per step."""
    groups: dict[tuple, list[TargetRow]] = {}
    for row in pred.rows:
        groups.setdefault(_group_key(row), []).append(row)
    out = []
    for (name, kind, k, n, m, dtypes), rows in groups.items():
        bf16 = sum(r.bf16_seconds for r in rows) * 1e3
        plan = sum(r.seconds for r in rows) * 1e3
        cast = sum(r.cast_seconds for r in rows) * 1e3
        ratio = bf16 / (plan + cast) if plan + cast else 0.0
        out.append(
            [name, kind, str(len(rows)), f"{m}x{k}x{n}", "/".join(dtypes), f"{bf16:.2f}", f"{plan:.2f}", f"{cast:.2f}", f"{ratio:.2f}"]
        )  # fmt: skip
    header = ["target", "kind", "n", "MxKxN", "fwd/dgrad/wgrad", "bf16 ms", "GEMM ms", "cast ms", "x bf16"]
    return table(header, out)


def published_table(rows: list[tuple[Published, float, float]]) -> str:
    """Predicted vs published, with the relative error and the bound the docs state."""
    out = []
    for p, value, err in rows:
        ok = "yes" if abs(err) <= 0.15 else "no"
        out.append(
            [p.label, p.gpu, p.recipe, p.measure, f"{p.value:.3f}", f"{value:.3f}", f"{err:+.1%}", ok, f"{p.bound:.0%}", p.source]
        )  # fmt: skip
    header = [
        "published figure",
        "GPU",
        "our recipe",
        "measures",
        "published",
        "predicted",
        "error",
        "within 15%",
        "bound",
        "source",
    ]
    within = sum(abs(e) <= 0.15 for _, _, e in rows)
    sources = "\n".join(f"- {k}: {v}" for k, v in SOURCES.items())
    return f"{table(header, out)}\n\n{within} of {len(rows)} within 15%.\n\nSources:\n{sources}"
