"""Codebook formats (``CodeFormat``: the dynamic-tree "dt8" / "udt8" of ``formats.table``), rounding onto them,
and their codes.

A code is the index of its value in the sorted book, so rounding is a search: the code of ``x`` is the number
of rounding thresholds ``x`` reaches (``torch.bucketize``, a binary search that vectorizes and compiles), and
decoding is a table lookup.

Nearest rounding follows bitsandbytes' and torchao's 8-bit optimizers: between neighbouring values
``lo < hi``, ``x`` goes up when ``fl32(x - lo) >= fl32(hi - lo) / 2``: nearest, a tie going up (to the larger
code). The fp32 difference is part of the rule: it rounds up one fp32 step below the exact midpoint in two
gaps of "dt8" (those between 5.5e-7 and 3.25e-6, either sign). ``CodeFormat.thresholds`` turns the rule into
one fp32 threshold per gap (the smallest ``x`` that goes up), so the search reproduces it for every fp32 input
(held to torchao's ``quantize_8bit_with_qmap`` at every threshold and one step below it in tests).

Values beyond the ends clamp to the end values; NaN gives the code of 0. Stochastic rounding goes up with
probability (x - lo) / (hi - lo); toward_zero takes the neighbour nearer 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .constants import kept
from .random import RandomSource, uniform


@dataclass(frozen=True)
class CodeFormat:
    """A codebook: ``2**bits`` sorted, distinct fp32 values in [-1, 1]; code i stands for ``values[i]``.

    Used under a scale (block absmax scaling: ``max`` is 1, so a block's amax maps to the top code). Rounding
    (``formats.codebook``): nearest value, a tie going to the larger code (bitsandbytes' / torchao's rule,
    their fp32 residual test included); values beyond the ends clamp to them (saturation always; an unsigned
    book clamps negatives to its smallest value, 0); NaN gives the code of 0. No inf, no NaN codes.

    Attributes:
        name: canonical name, e.g. ``"dt8"``.
        values: the code values, ascending (fp32 numbers as Python floats).
        signed: False when every value is >= 0 (for non-negative states such as sqrt(v)).
    """

    name: str
    values: tuple[float, ...] = field(repr=False)
    signed: bool = True
    thresholds: tuple[float, ...] = field(init=False, repr=False, compare=False)
    """For each gap k (between values k and k + 1), the smallest fp32 number that rounds up to code k + 1
    (derived from ``values`` once, here, so that traced code reads constants: ``round_up_thresholds``)."""

    def __post_init__(self) -> None:
        n = len(self.values)
        if n < 2 or n & (n - 1) or n > 256:
            raise ValueError(f"CodeFormat {self.name!r}: {n} values; allowed a power of two in [2, 256]")
        if any(b <= a for a, b in zip(self.values, self.values[1:], strict=False)):
            raise ValueError(f"CodeFormat {self.name!r}: values must be strictly ascending")
        if not (-1.0 <= self.values[0] and self.values[-1] == 1.0) or (self.values[0] < 0) != self.signed:
            raise ValueError(
                f"CodeFormat {self.name!r}: values must lie in [-1, 1], top 1, signed={self.signed}"
            )
        if 0.0 not in self.values:
            raise ValueError(f"CodeFormat {self.name!r}: 0 must be a code value")
        object.__setattr__(self, "thresholds", round_up_thresholds(self.values))

    @property
    def kind(self) -> str:
        return "code"

    @property
    def bits(self) -> int:
        return (len(self.values) - 1).bit_length()

    @property
    def n_codes(self) -> int:
        return len(self.values)

    @property
    def max(self) -> float:
        """The largest value (1): a block scale amax / max maps the block's amax to the top code."""
        return self.values[-1]

    @property
    def max_step(self) -> float:
        """The gap between ``max`` and the next value below it."""
        return self.values[-1] - self.values[-2]

    @property
    def emax(self) -> int:
        """floor(log2(max)) = 0: the exponent power-of-two (MX-style) scaling maps the amax's binade to."""
        return int(math.floor(math.log2(self.max)))

    @property
    def min_subnormal(self) -> float:
        """The smallest positive value."""
        return min(v for v in self.values if v > 0)

    @property
    def zero_code(self) -> int:
        return self.values.index(0.0)

    @property
    def significant_bits(self) -> int:
        """Significand bits its values need (24: arbitrary fp32 numbers, as the dynamic tree's are)."""
        return max(24 - (_trailing_zero_bits(v) if v else 24) for v in self.values)

    has_inf = False
    has_nan = False
    saturates_always = True

    def __str__(self) -> str:
        return self.name


def _rounds_up(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' / torchao's nearest rule between neighbours lo < hi, in fp32 (``formats.codebook``)."""
    return (x - lo) >= (hi - lo) * 0.5


def round_up_thresholds(values: tuple[float, ...]) -> tuple[float, ...]:
    """For each gap between neighbouring ``values`` (fp32 numbers, ascending), the smallest fp32 ``x`` with
    ``fl32(x - lo) >= fl32(hi - lo) / 2``: the exact midpoint, or one fp32 step from it where the fp32
    difference rounds (``formats.codebook``)."""
    v = torch.tensor(values, dtype=torch.float32)
    lo, hi = v[:-1], v[1:]
    mid = (lo.double() + hi.double()) / 2  # exact: both are fp32 numbers within 2**29 of each other
    t = mid.float()
    t = torch.where(t.double() < mid, torch.nextafter(t, hi), t)  # the smallest fp32 >= the midpoint
    inf = torch.full_like(t, math.inf)
    for _ in range(8):  # step to where the fp32 rule switches (a step or two at most; it is monotone in x)
        below = torch.nextafter(t, -inf)
        t = torch.where((below > lo) & _rounds_up(below, lo, hi), below, t)
        t = torch.where(~_rounds_up(t, lo, hi) & (t < hi), torch.nextafter(t, inf), t)
    return tuple(t.tolist())


def _trailing_zero_bits(v: float) -> int:
    """Trailing zero bits of the 24-bit significand of fp32 number ``v`` (!= 0)."""
    sig = int(abs(math.frexp(v)[0]) * 2**24)
    return (sig & -sig).bit_length() - 1


def dynamic_tree_values(signed: bool, bits: int = 8) -> tuple[float, ...]:
    """The dynamic-tree map of bitsandbytes' 8-bit optimizers (Dettmers et al., arXiv 1511.04561 / 2110.02861),
    as torchao's ``create_dynamic_map`` builds it (held equal value for value in tests).

    ``bits - 1`` decades 10**-(bits-2) .. 10**0; decade i (0 = the smallest) holds ``2**i`` values (signed: and
    their negatives) or ``2**(i + 1)`` (unsigned), the midpoints of an even split of [0.1, 1] into that many
    intervals, times 10**(i - bits + 2). Then 0 and 1 are added: 2**bits values (the signed map has no -1).
    The arithmetic is that of the reference: the split points in fp32 (``torch.linspace``), their midpoints in
    fp32, the product with the decade's power of ten in fp32.
    """
    decades = bits - 1
    mags: list[float] = []
    for i in range(decades):
        n = 2**i if signed else 2 ** (i + 1)
        edges = torch.linspace(0.1, 1.0, n + 1, dtype=torch.float32)
        mags += (((edges[1:] + edges[:-1]) / 2) * 10.0 ** (i - decades + 1)).tolist()
    values = [0.0, 1.0, *mags, *([-m for m in mags] if signed else [])]
    return tuple(sorted(values))


_TABLES: dict[tuple, torch.Tensor] = {}


def tables(fmt: CodeFormat, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, thresholds) of ``fmt`` as fp32 tensors on ``device`` (kept: ``constants.kept``)."""
    device = torch.device(device)
    return tuple(
        kept(_TABLES, (fmt, device, part), lambda part=part: torch.tensor(getattr(fmt, part), device=device))
        for part in ("values", "thresholds")
    )


def code_indices(
    x: torch.Tensor, fmt: CodeFormat, rounding: str = "nearest", generator: RandomSource = None
) -> torch.Tensor:
    """int64 codes of fp32 ``x`` (values in scale units) rounded onto ``fmt`` (see the module docstring)."""
    values, ts = tables(fmt, x.device)
    x = torch.where(x == x, x, 0.0)  # NaN -> 0 (x != x vectorizes where isnan does not)
    if rounding == "nearest":
        return torch.bucketize(x, ts, right=True)  # the number of thresholds <= x
    n = len(fmt.values)
    x = x.clamp(fmt.values[0], fmt.values[-1])
    lo = (torch.bucketize(x, values, right=True) - 1).clamp_(0, n - 2)  # values[lo] <= x, lo <= n - 2
    vlo, vhi = values[lo], values[lo + 1]
    if rounding == "toward_zero":
        up = (x < 0) & (x > vlo)
    else:  # stochastic: up with probability (x - lo) / (hi - lo)
        up = uniform(x.shape, generator, x.device) < (x - vlo) / (vhi - vlo)
    return lo + up.to(lo.dtype)


def round_code(
    x: torch.Tensor, fmt: CodeFormat, rounding: str = "nearest", generator: RandomSource = None
) -> torch.Tensor:
    """fp32 ``x`` rounded onto ``fmt``'s values (``rounding.round_to``'s codebook route)."""
    return decode_code(code_indices(x, fmt, rounding, generator), fmt)


def encode_code(y: torch.Tensor, fmt: CodeFormat) -> torch.Tensor:
    """uint8 codes of fp32 values on ``fmt``'s grid (its nearest code, so any value is accepted)."""
    return code_indices(y.to(torch.float32), fmt).to(torch.uint8)


def decode_code(codes: torch.Tensor, fmt: CodeFormat) -> torch.Tensor:
    """fp32 values of codes (a table lookup)."""
    return tables(fmt, codes.device)[0][codes.long()]
