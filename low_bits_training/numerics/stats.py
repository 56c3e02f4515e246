"""Quantization statistics of one operand: a flat vector of raw sums that ranks and microbatches combine.

A statistic is kept as *raw* numbers (counts, energies, extrema) so that combining shards, microbatches and
ranks is exact: counts and energies add, amax takes the max, the smallest scale the min. Ratios (fractions,
SQNR in dB, the mean scale) are only formed at the end by ``summarize``. The layout of the vector is data
(``FIELDS``) so the caller (titan/) can reduce each slot with its own op; nothing here communicates.

Definitions (x: the high-precision operand, q: its quantized value, s: its group's dequant scale):

- underflow: x != 0 and q == 0 (the value flushed to zero)
- saturated: |x / s| > max of the element format (clamped to +-max, or inf/NaN without saturation)
- clipped: |x / s| > max + half the format's top grid step: values round to nearest would have put past
  max, so clamping loses more than rounding would (a rounded block scale, NVFP4's ue4m3, lifts a block's
  largest value just above max on ordinary data: saturated, not clipped)
- SQNR (dB): 10 log10(sum x^2 / sum (x - q)^2), over finite x; +inf when q == x
- exponent histogram: floor(log2 |x / s|) of the nonzero finite values, clipped to [HIST_LO, HIST_HI)
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch

from low_bits_training.formats import QuantSpec, fake_quantize, group_scales, grouped_shape

Reduce = Literal["sum", "max", "min"]


class Field(NamedTuple):
    """One slot of the raw statistics vector and how two of them combine."""

    name: str
    reduce: Reduce


FIELDS: tuple[Field, ...] = (
    Field("n", "sum"),  # elements
    Field("nonzero", "sum"),  # finite nonzero elements of x
    Field("underflow", "sum"),
    Field("saturated", "sum"),
    Field("clipped", "sum"),
    Field("nonfinite", "sum"),  # NaN / inf in x
    Field("signal", "sum"),  # sum x^2 (finite x)
    Field("noise", "sum"),  # sum (x - q)^2 (finite x)
    Field("amax", "max"),  # max |x| over finite x
    Field("scale_min", "min"),
    Field("scale_max", "max"),
    Field("scale_sum", "sum"),
    Field("groups", "sum"),  # number of scale groups
)
HIST_LO, HIST_HI = -40, 24
"""Exponent histogram range: bucket i counts floor(log2 |x/s|) == HIST_LO + i (ends clipped)."""
N_BINS = HIST_HI - HIST_LO
SIZE = len(FIELDS) + N_BINS
"""Length of a raw statistics vector: the fields, then the histogram counts (which add)."""
_INDEX = {f.name: i for i, f in enumerate(FIELDS)}


def reduce_ops() -> list[Reduce]:
    """The combine op of every slot of a raw vector (``FIELDS`` then ``N_BINS`` times "sum")."""
    return [f.reduce for f in FIELDS] + ["sum"] * N_BINS


def identity() -> torch.Tensor:
    """The raw vector of no elements (float64): zeros, with min slots at +inf (neutral under ``combine``)."""
    v = torch.zeros(SIZE, dtype=torch.float64)
    v[_INDEX["scale_min"]] = math.inf
    return v


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Combine two raw vectors (or stacks of them, last dim = SIZE) slot by slot: sum, max or min.

    Args:
        a, b: raw statistics of the same shape.

    Returns:
        The raw statistics of the union of both sets of elements.
    """
    out = a + b
    for i, f in enumerate(FIELDS):
        if f.reduce == "max":
            out[..., i] = torch.maximum(a[..., i], b[..., i])
        elif f.reduce == "min":
            out[..., i] = torch.minimum(a[..., i], b[..., i])
    return out


def exponent_histogram(v: torch.Tensor) -> torch.Tensor:
    """Counts of floor(log2 |v|) over the nonzero finite values, clipped to [HIST_LO, HIST_HI) (float64).

    Static shapes only (one scatter-add into N_BINS + 1 buckets, the last one collecting zeros and
    non-finite values), so it runs inside compiled graphs.

    Args:
        v: any tensor (typically x / scale).

    Returns:
        (N_BINS,) float64 counts; bucket i is exponent HIST_LO + i.
    """
    a = v.detach().abs().flatten().to(torch.float32)
    valid = (a > 0) & torch.isfinite(a)
    e = torch.floor(torch.log2(torch.where(valid, a, 1.0))).clamp_(HIST_LO, HIST_HI - 1).to(torch.int64)
    idx = torch.where(valid, e - HIST_LO, N_BINS)
    counts = torch.zeros(N_BINS + 1, dtype=torch.float64, device=a.device)
    counts.scatter_add_(0, idx, torch.ones_like(idx, dtype=torch.float64))
    return counts[:N_BINS]


def operand_stats(x: torch.Tensor, spec: QuantSpec, q: torch.Tensor | None = None) -> torch.Tensor:
    """Raw statistics of quantizing ``x`` under ``spec``.

    Args:
        x: the high-precision operand (any shape fitting the spec).
        spec: its quantization recipe.
        q: its quantized value (x's shape) if already computed; else ``fake_quantize(x, spec)``.

    Returns:
        (SIZE,) float64 raw vector (see ``FIELDS``); combine with ``combine``, read with ``summarize``.

    Raises:
        ValueError: the shape does not fit the spec.
    """
    x = x.detach()
    gshape, dims = grouped_shape(x.shape, spec)
    xg = x.reshape(gshape).to(torch.float32)
    scale = group_scales(xg, spec, dims).scale  # keepdim, broadcasts over xg
    q = fake_quantize(x, spec) if q is None else q.detach()
    qg = q.reshape(gshape).to(torch.float32)
    finite = torch.isfinite(xg)
    xf = torch.where(finite, xg, 0.0)
    scaled = xf / scale
    out = torch.empty(SIZE, dtype=torch.float64, device=x.device)
    vals = {
        "n": float(x.numel()),
        "nonzero": (xf != 0).sum(),
        "underflow": ((xf != 0) & (qg == 0)).sum(),
        "saturated": (scaled.abs() > spec.elem.max).sum(),
        "clipped": (scaled.abs() > spec.elem.max + spec.elem.max_step / 2).sum(),
        "nonfinite": (~finite).sum(),
        "signal": xf.double().square().sum(),
        "noise": torch.where(finite, xg - qg, 0.0).double().square().sum(),
        "amax": xf.abs().amax() if xf.numel() else 0.0,
        "scale_min": scale.amin(),
        "scale_max": scale.amax(),
        "scale_sum": scale.double().sum(),
        "groups": float(scale.numel()),
    }
    for name, v in vals.items():
        out[_INDEX[name]] = v
    out[len(FIELDS) :] = exponent_histogram(scaled)
    return out


def sqnr_db(signal: float, noise: float) -> float:
    """10 log10(signal / noise) in dB; +inf for zero noise, -inf for zero signal with noise, NaN for 0/0."""
    if noise == 0:
        return math.inf if signal > 0 else math.nan
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def summarize(raw: torch.Tensor) -> dict[str, float | list[float]]:
    """The numbers a person reads, from a (combined, reduced) raw vector.

    Args:
        raw: (SIZE,) raw statistics.

    Returns:
        ``amax``, ``scale_mean`` / ``scale_min`` / ``scale_max``, ``underflow`` (fraction of the nonzero
        values), ``saturation``, ``clipping`` and ``nonfinite`` (fractions of all values), ``sqnr_db``, ``n``, and
        ``hist`` (fractions of the nonzero values per exponent bucket, from HIST_LO).
    """
    r = raw.detach().to(torch.float64).cpu().tolist()
    g = {f.name: r[i] for i, f in enumerate(FIELDS)}
    n, nz, groups = g["n"], g["nonzero"], g["groups"]
    hist = r[len(FIELDS) :]
    return {
        "n": n,
        "amax": g["amax"],
        "scale_mean": g["scale_sum"] / groups if groups else math.nan,
        "scale_min": g["scale_min"] if groups else math.nan,
        "scale_max": g["scale_max"] if groups else math.nan,
        "underflow": g["underflow"] / nz if nz else 0.0,
        "saturation": g["saturated"] / n if n else 0.0,
        "clipping": g["clipped"] / n if n else 0.0,
        "nonfinite": g["nonfinite"] / n if n else 0.0,
        "sqnr_db": sqnr_db(g["signal"], g["noise"]),
        "hist": [h / nz if nz else 0.0 for h in hist],
    }
