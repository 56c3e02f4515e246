"""What-if statistics: what another format would do to an operand, as a raw vector that combines like
``numerics.stats`` (and rows for ``numerics.jsonl`` marked with the alternative's name).

The raw vector is ``operand_stats`` (underflow, saturation, SQNR energies, amax, scales, exponent histogram)
followed by ``EXTRA``: the block dynamic range, i.e. per scale group the binades log2(amax / smallest nonzero
|x|) the group's values span. A group spanning more binades than the element format holds (log2(max / min
subnormal): 3.6 for e2m1, 17 for e4m3) cannot keep its smallest values however it is scaled.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

from low_bits_training.formats import QuantSpec, fake_quantize, grouped_shape
from low_bits_training.numerics.records import headline_metrics

from .records import plain, rows
from .stats import FIELDS, SIZE, Reduce, combine, identity, operand_stats, reduce_ops, summarize


class Extra(NamedTuple):
    name: str
    reduce: Reduce


EXTRA: tuple[Extra, ...] = (
    Extra("dr_sum", "sum"),  # sum over groups with a nonzero value of log2(amax / min nonzero |x|)
    Extra("dr_max", "max"),
    Extra("dr_groups", "sum"),  # groups with a nonzero value
    Extra("dr_over", "sum"),  # of those, groups spanning more binades than the element format
)
WHATIF_SIZE = SIZE + len(EXTRA)
"""Length of a what-if raw vector: ``numerics.stats`` slots, then ``EXTRA``."""
_MAX_COLS = [SIZE + i for i, e in enumerate(EXTRA) if e.reduce == "max"]


def whatif_reduce_ops() -> list[Reduce]:
    """The combine op of every slot of a what-if raw vector."""
    return reduce_ops() + [e.reduce for e in EXTRA]


def whatif_identity() -> torch.Tensor:
    """The what-if raw vector of no elements (float64)."""
    return torch.cat([identity(), torch.zeros(len(EXTRA), dtype=torch.float64)])


def combine_whatif(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Combine two what-if raw vectors (or stacks, last dim ``WHATIF_SIZE``) slot by slot."""
    out = a + b
    out[..., :SIZE] = combine(a[..., :SIZE], b[..., :SIZE])
    for i in _MAX_COLS:
        out[..., i] = torch.maximum(a[..., i], b[..., i])
    return out


def format_binades(spec: QuantSpec) -> float:
    """log2(max / smallest positive) of the element format: the binades one scale group can hold."""
    return math.log2(spec.elem.max / spec.elem.min_subnormal)


def block_range(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """The ``EXTRA`` slots of ``x`` grouped as ``spec`` groups it (float64, static shapes, no host sync).

    Args:
        x: the operand (any shape fitting the spec).
        spec: the format whose scale groups are measured.

    Returns:
        (len(EXTRA),) float64: dr_sum, dr_max, dr_groups, dr_over.
    """
    gshape, dims = grouped_shape(x.shape, spec)
    a = x.detach().reshape(gshape).to(torch.float32).abs()
    nz = (a > 0) & torch.isfinite(a)
    if not dims:  # scaling "none": every element is its own group, spanning 0 binades
        groups = nz.sum().to(torch.float64)
        return torch.stack([groups * 0, groups * 0, groups, groups * 0])
    big = torch.where(nz, a, 0.0).amax(dim=dims)
    small = torch.where(nz, a, math.inf).amin(dim=dims)
    has = big > 0
    span = torch.where(has, torch.log2(big / torch.where(has, small, 1.0)), 0.0).to(torch.float64)
    over = (span > format_binades(spec)) & has
    return torch.stack([span.sum(), span.amax(), has.sum().to(torch.float64), over.sum().to(torch.float64)])


def whatif_stats(x: torch.Tensor, spec: QuantSpec, key: torch.Tensor | None = None) -> torch.Tensor:
    """The what-if raw vector of quantizing ``x`` (as fp32, as a GEMM operand cast does) under ``spec``.

    Args:
        x: the high-precision operand.
        spec: the alternative format (axis already along the role's contraction dim).
        key: int64 key tensor for stochastic rounding (None: torch's global RNG).

    Returns:
        (WHATIF_SIZE,) float64 raw vector.

    Raises:
        ValueError: the shape does not fit the spec.
    """
    x32 = x.detach().to(torch.float32)
    q = fake_quantize(x32, spec, key)
    return torch.cat([operand_stats(x32, spec, q), block_range(x32, spec)])


def summarize_whatif(raw: torch.Tensor) -> dict[str, float]:
    """The extra numbers of a what-if row: ``mse`` (mean squared error over all values) and the block dynamic
    range: ``block_dr_mean`` / ``block_dr_max`` (binades) and ``block_dr_over`` (fraction of groups spanning
    more binades than the format holds)."""
    r = raw.detach().to(torch.float64).cpu().tolist()
    e = dict(zip([x.name for x in EXTRA], r[SIZE:], strict=True))
    n, noise = r[_field("n")], r[_field("noise")]
    g = e["dr_groups"]
    return {
        "mse": noise / n if n else math.nan,
        "block_dr_mean": e["dr_sum"] / g if g else math.nan,
        "block_dr_max": e["dr_max"] if g else math.nan,
        "block_dr_over": e["dr_over"] / g if g else 0.0,
    }


def _field(name: str) -> int:
    return next(i for i, f in enumerate(FIELDS) if f.name == name)


def whatif_rows(
    step: int, keys: list[tuple[str, str, str]], raw: torch.Tensor, specs: dict[tuple[str, str, str], str]
) -> list[dict[str, Any]]:
    """``numerics.jsonl`` rows of what-if statistics: the usual row fields plus ``whatif`` (the alternative's
    name) and ``mse`` / ``block_dr_*`` (``summarize_whatif``).

    Args:
        step: training step.
        keys: ``(layer, role, whatif name)`` per row of ``raw``.
        raw: (len(keys), WHATIF_SIZE) reduced raw vectors.
        specs: key -> spec label.
    """
    out = []
    for key, r in zip(keys, raw, strict=True):
        layer, role, name = key
        row = rows(step, [(layer, role)], r[:SIZE].unsqueeze(0), {(layer, role): specs.get(key, "")})
        if not row:
            continue  # no elements: that GEMM did not run
        row[0]["whatif"] = name
        row[0].update({k: plain(v) for k, v in summarize_whatif(r).items()})
        out.append(row[0])
    return out


def whatif_headlines(table: list[dict[str, Any]], per_layer: bool) -> dict[str, float]:
    """Metrics-logger scalars of what-if rows: per alternative and role the worst layer,
    ``numerics/whatif/<name>/<role>/underflow_max``, ``.../saturation_max``, ``.../clipping_max``,
    ``.../sqnr_db_min``."""

    return headline_metrics([{**r, "role": f"whatif/{r['whatif']}/{r['role']}"} for r in table], per_layer)


__all__ = [
    "EXTRA",
    "WHATIF_SIZE",
    "block_range",
    "combine_whatif",
    "format_binades",
    "summarize",
    "summarize_whatif",
    "whatif_headlines",
    "whatif_identity",
    "whatif_reduce_ops",
    "whatif_rows",
    "whatif_stats",
]
