"""Rows of ``numerics.jsonl`` and the scalars sent to TensorBoard / W&B, from reduced raw statistics."""

from __future__ import annotations

import math
from typing import Any

import torch

from .stats import HIST_LO, summarize

NUMERICS_FILE = "numerics.jsonl"
HEADLINE = ("underflow", "saturation", "clipping", "sqnr_db")
"""The per-(layer, role) numbers that go to the metrics loggers (everything goes to the JSONL file)."""


def plain(v: float) -> float | str:
    """JSON has no inf / NaN: keep them as the strings "inf", "-inf", "nan"."""
    return v if math.isfinite(v) else str(v)


def rows(step: int, keys: list[tuple[str, str]], raw: torch.Tensor, specs: dict) -> list[dict[str, Any]]:
    """One row per (layer, role): ``{"step", "layer", "role", "spec", amax, scale_*, underflow, ...}``.

    Args:
        step: training step.
        keys: ``(layer_fqn, role_name)`` per row of ``raw``.
        raw: (len(keys), SIZE) reduced raw statistics.
        specs: ``{(layer, role): spec label}``.

    Returns:
        JSON-ready dicts; ``hist`` holds fractions per exponent bucket starting at ``hist_lo``.
    """
    out = []
    for (layer, role), r in zip(keys, raw, strict=True):
        s = summarize(r)
        if s["n"] == 0:
            continue
        row: dict[str, Any] = {
            "step": step,
            "layer": layer,
            "role": role,
            "spec": specs.get((layer, role), ""),
        }
        row.update({k: plain(v) for k, v in s.items() if k != "hist"})
        row.update(hist_lo=HIST_LO, hist=[round(h, 6) for h in s["hist"]])
        out.append(row)
    return out


def headline_metrics(table: list[dict[str, Any]], per_layer: bool) -> dict[str, float]:
    """Scalars for the metrics loggers: per role the worst layer (``numerics/<role>/underflow_max``,
    ``.../saturation_max``, ``.../clipping_max``, ``.../sqnr_db_min``), and with ``per_layer`` every layer's headline numbers."""
    out: dict[str, float] = {}
    for row in table:
        role = row["role"]
        for k in HEADLINE:
            v = float(row[k])
            worst, name = (
                (min, f"numerics/{role}/{k}_min") if k == "sqnr_db" else (max, f"numerics/{role}/{k}_max")
            )
            out[name] = worst(out.get(name, v), v)
            if per_layer:
                out[f"numerics/{row['layer']}/{role}/{k}"] = v
    return out
