"""Adaptive block scaling "4over6": per group, map the amax to 6 or to 4, whichever rounds with less error.

FP4 (e2m1) has the grid 0, 0.5, 1, 1.5, 2, 3, 4, 6: between 4 and 6 there is nothing, so with the usual
scale (amax -> 6) a group's near-maximal values (those scaled into (4, 6)) carry the largest errors. Scaling
the amax to 4 instead puts them on the finer part of the grid; for some groups that is better. Four Over Six
(Cook et al., arXiv 2512.02010; Transformer Engine's 4over6 NVFP4 recipe) computes both candidates for every
group and keeps the one whose round-to-nearest dequantized values lie closer to the input: "mse" compares
sums of squared errors, "mae" sums of absolute errors; a tie keeps 6. Because a block scale may now be 1.5x
larger, the two-level tensor scale maps the tensor amax to 6 * 256 instead of 6 * 448 (``TENSOR_SCALE_MAX``)
so the larger block scales still fit ue4m3.

The choice uses round-to-nearest errors whatever the spec's rounding, so with stochastic rounding the
choice depends on the values only and each group's rounding stays unbiased given its scale. Errors are
summed in float64 (the squares of fp32 differences are exact there), so eager and compiled runs choose alike
except for sums that differ in the last fp64 bit.
"""

from __future__ import annotations

import struct
from fractions import Fraction

import torch

from .reference import ref_round
from .rounding import round_to

TARGETS: tuple[float, float] = (6.0, 4.0)
"""The element values a group's amax is mapped to: the usual one first (kept on a tie)."""
TENSOR_SCALE_MAX = 256.0
"""The scale-format max the two-level tensor scale uses under 4over6 (448 otherwise, for ue4m3)."""


def group_error(
    xg: torch.Tensor, scale: torch.Tensor, dims: tuple[int, ...], criterion: str, reciprocal: bool = False
) -> torch.Tensor:
    """Per-group error of round-to-nearest e2m1 under ``scale`` (float64, keepdim over ``dims``).

    Args:
        xg: grouped fp32 values.
        scale: effective dequant scale per group (block scale * tensor scale), broadcastable to ``xg``.
        dims: the group dims.
        criterion: "mse" (sum of squares) or "mae" (sum of magnitudes).
        reciprocal: the values meet the scale as ``xg * fl(1 / scale)`` (``QuantSpec.scale_apply``).
    """
    q = round_to(xg * (1.0 / scale) if reciprocal else xg / scale, "e2m1", "nearest", saturate=True) * scale
    d = (q - xg).to(torch.float64)
    d = d.square() if criterion == "mse" else d.abs()
    return d.sum(dim=dims, keepdim=True)


def choose(
    xg: torch.Tensor,
    candidates: tuple[torch.Tensor, torch.Tensor],
    tensor_scale: torch.Tensor | None,
    dims: tuple[int, ...],
    criterion: str,
    reciprocal: bool = False,
) -> torch.Tensor:
    """The block scale of each group: the candidate (amax -> 6, amax -> 4) with the smaller error.

    Args:
        xg: grouped fp32 values.
        candidates: block scales (on the scale format's grid) mapping each group's amax to 6 and to 4.
        tensor_scale: the two-level fp32 tensor scale, or None.
        dims: the group dims.
        criterion: "mse" | "mae".
        reciprocal: as ``group_error``.

    Returns:
        The chosen block scale per group (candidate 6 on ties and where an error is NaN).
    """
    ts = 1.0 if tensor_scale is None else tensor_scale
    e6, e4 = (group_error(xg, c * ts, dims, criterion, reciprocal) for c in candidates)
    return torch.where(e4 < e6, candidates[1], candidates[0])


def _f32(v: float) -> float:
    # A Python float rounded to fp32 (RNE): an fp64 sum, difference, product or quotient of fp32 values
    # rounded this way is the fp32 operation's result (53 >= 2 * 24 + 2 bits: no double-rounding error).
    return struct.unpack("f", struct.pack("f", v))[0]


def reference_choice(values: list[float], scales: tuple[float, float], criterion: str) -> float:
    """The slow definition of ``choose`` for one group: exact rational error sums, one value at a time.

    The dequantized values and their differences are the fp32 ones the fast path computes; only the sum
    differs (exact here, float64 there).

    Args:
        values: the group's values (Python floats, finite).
        scales: the effective scales (block * tensor) of the candidates amax -> 6 and amax -> 4.
        criterion: "mse" | "mae".

    Returns:
        The chosen effective scale.
    """
    errors = []
    for s in scales:
        err = Fraction(0)
        for v in values:
            d = Fraction(_f32(_f32(ref_round(_f32(v / s), "e2m1") * s) - v))
            err += d * d if criterion == "mse" else abs(d)
        errors.append(err)
    return scales[1] if errors[1] < errors[0] else scales[0]
