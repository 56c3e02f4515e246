"""Slow, obviously-correct scalar reference: one Python float at a time, exact rational arithmetic.

The fast tensor paths (``rounding.round_to``, ``codec.decode``) are held to these bit for bit in
tests/formats. Nothing here is vectorised or clever: read it as the definition of the numerics.

Tie rule: "nearest" breaks a tie toward the neighbour whose integer significand, counted in units of the
binade's spacing 2**(E - mbits), is even. For mbits >= 1 that is IEEE round-half-to-even (the code with
mantissa lsb 0); for mbits == 0 (e8m0) it is always the upper neighbour, which is what torch's and
ml_dtypes' float8_e8m0fnu casts do.
"""

from __future__ import annotations

import math
from fractions import Fraction

from .table import FloatFormat, Format, IntFormat, get_format

NAN = float("nan")


def ref_decode(code: int, fmt: str | Format) -> float:
    """The value of one bit code (an int in [0, 2**bits)), from the bit fields."""
    fmt = get_format(fmt)
    if isinstance(fmt, IntFormat):
        return float(code - 2**fmt.bits if code >= 2 ** (fmt.bits - 1) else code)
    body_bits = fmt.ebits + fmt.mbits
    sign = -1.0 if fmt.signed and code >> body_bits else 1.0
    body = code & (2**body_bits - 1)
    field, mant = body >> fmt.mbits, body & (2**fmt.mbits - 1)
    top = 2**fmt.ebits - 1
    if fmt.specials == "ieee" and field == top:
        return sign * math.inf if mant == 0 else NAN
    if fmt.specials == "fn" and body == 2**body_bits - 1:
        return NAN
    if field == 0 and fmt.subnormals:
        return sign * math.ldexp(mant, fmt.emin - fmt.mbits)
    return sign * math.ldexp(2**fmt.mbits + mant, field - fmt.bias - fmt.mbits)


def _round_int(n: Fraction, rounding: str, u: float | None) -> int:
    """Round a non-negative rational to an integer."""
    lo = math.floor(n)
    frac = n - lo
    if rounding == "toward_zero":
        return lo
    if rounding == "stochastic":
        return lo + (1 if Fraction(u) < frac else 0)
    if frac != Fraction(1, 2):
        return lo + (1 if frac > Fraction(1, 2) else 0)
    return lo if lo % 2 == 0 else lo + 1


def _spacing(a: Fraction, fmt: Format) -> Fraction:
    """Grid spacing around a >= 0: 2**(E - mbits) with E = max(floor(log2 a), emin); 1 for integers."""
    if isinstance(fmt, IntFormat):
        return Fraction(1)
    e = fmt.emin if a == 0 else max(math.floor(math.log2(a)), fmt.emin)
    while Fraction(2) ** e > a and e > fmt.emin:  # guard log2 rounding near powers of two
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    return Fraction(2) ** (e - fmt.mbits)


def _overflow(sign: float, fmt: Format, saturate: bool) -> float:
    if saturate or fmt.saturates_always:
        return sign * fmt.max
    return sign * math.inf if fmt.has_inf else NAN


def ref_round(
    x: float, fmt: str | Format, rounding: str = "nearest", saturate: bool = True, u: float | None = None
) -> float:
    """Round one value onto fmt's grid (the definition ``round_to`` implements).

    Args:
        x: the value (any Python float, incl. +-0, +-inf, NaN).
        fmt: format name or object.
        rounding: "nearest" | "toward_zero" | "stochastic" (then ``u`` in [0, 1) decides: round up iff
            u < the fractional distance above the lower neighbour).
        saturate: overflow -> +-max; else inf / NaN as the format has them (clamp if it has neither).
        u: the uniform draw for stochastic rounding.

    Returns:
        The rounded value as a Python float.
    """
    fmt = get_format(fmt)
    if math.isnan(x) or (not fmt.signed and x < 0):
        return NAN
    sign = math.copysign(1.0, x)
    if math.isinf(x):
        return _overflow(sign, fmt, saturate)
    a = Fraction(abs(x))
    q = _spacing(a, fmt)
    r = _round_int(a / q, rounding, u) * q
    if r > Fraction(fmt.max):
        return _overflow(sign, fmt, saturate)
    if isinstance(fmt, FloatFormat) and not fmt.has_zero:
        r = max(r, Fraction(fmt.min_normal))
    return math.copysign(float(r), sign) if fmt.signed else abs(float(r))


def ref_grid(fmt: str | Format) -> list[float]:
    """Every code's value, in code order (formats of <= 16 bits)."""
    fmt = get_format(fmt)
    return [ref_decode(c, fmt) for c in range(fmt.n_codes)]
