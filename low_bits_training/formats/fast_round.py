"""The fast round-to-grid routes of ``rounding.round_magnitude``, each for the formats its ``*_ok`` /
``binade_format`` test admits, each held bit for bit to ``reference.ref_round`` in tests.

Round-half-even by one fp32 add and subtract (``rne_magic``: fp16, fp8, fp6, fp4, generic eXmY), by integer
rounding of the fp32 bit pattern (``rne_bits``: bf16 and other e8mY), stochastic rounding on the bit pattern
(``sr_bits``), and the two routes torch.compile takes on the CPU for the small formats (``rne_binades``,
``sr_binades``), where the spacing of a value's binade is picked by comparisons instead of from the exponent
bits, because inductor's C++ backend runs bit reinterpretations element by element. Inputs are fp32
magnitudes >= 0 (inf / NaN pass through); no overflow rule (the caller applies it).
"""

from __future__ import annotations

import torch

from .random import uniform_int
from .table import FloatFormat, Format


def magic_ok(fmt: FloatFormat) -> bool:
    """True where ``rne_magic`` rounds ``fmt`` exactly: it needs a < C (mbits <= 22), C finite for a up to
    2**(emax+2), and a subnormal grid below emin."""
    return 1 <= fmt.mbits <= 22 and fmt.subnormals and fmt.emax + 2 + 23 - fmt.mbits <= 127


def rne_magic(a: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Round-half-even of magnitudes a (fp32, modified in place) by one fp32 add and subtract.

    With C = 2**(max(floor(log2 a), emin) + 23 - mbits), a < C, so a + C lies in [C, 2C) where the fp32 spacing
    is exactly the format's spacing 2**(E - mbits): the hardware's round-half-even add does the rounding and
    subtracting C is exact. C is built from a's exponent field, clamped at 2**(emax + 2 + 23 - mbits) so it
    stays finite: larger a (which overflow anyway) then round at their own fp32 spacing and stay above max;
    inf and NaN pass through. No multiply, so FMA
    contraction cannot change it; it relies on the compiler not reassociating (a + C) - C (inductor
    compiles without -funsafe-math-optimizations).
    """
    c = (a.view(torch.int32) & 0x7F800000).clamp_((fmt.emin + 127) << 23, (fmt.emax + 129) << 23)
    c = c.add_((23 - fmt.mbits) << 23).view(torch.float32)
    return a.add_(c).sub_(c)


def bits_ok(fmt: FloatFormat) -> bool:
    """True where ``rne_bits`` rounds ``fmt`` exactly: 8 exponent bits and subnormals, so the format's grid is
    fp32's with the low 23 - mbits bits cleared."""
    return fmt.ebits == 8 and fmt.subnormals and 1 <= fmt.mbits <= 23


def rne_bits(a: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Round-half-even of magnitudes a onto an e8mY grid (bf16, e8m3, ...) on the fp32 bit pattern.

    Adding 2**(d-1) - 1 plus the kept lsb and clearing the low d = 23 - mbits bits rounds the significand,
    carrying into the exponent (and to the inf pattern past max) as it should; fp32 subnormals are linear in
    their bits, so the subnormal range is right too. (Not ``a.to(torch.bfloat16)``: inductor may fold such
    a down-and-up cast pair away unless emulate_precision_casts is set.) NaN is restored explicitly.
    """
    d = 23 - fmt.mbits
    if d == 0:
        return a
    b = a.view(torch.int32)
    r = ((b >> d) & 1).add_(b).add_((1 << (d - 1)) - 1).bitwise_and_(-(1 << d)).view(torch.float32)
    return torch.where(torch.isnan(a), a, r)


def sr_bits(a: torch.Tensor, fmt: FloatFormat, generator) -> torch.Tensor:
    """Stochastic rounding of magnitudes a on the fp32 bit pattern (formats with 1 <= mbits <= 22).

    Adding a uniform integer R in [0, 2**d) to the pattern and clearing the low d = 23 - mbits bits rounds up
    with probability (low bits) / 2**d = the exact fractional position: the reference's rule with the draw
    u = (2**d - 1 - R) / 2**d. Below the format's min normal the spacing is fixed, so a is first offset by
    min_normal (one fp32 rounding at 2**(emin - 23), i.e. 2**-d of the spacing: values with bits finer than
    that, deep in the subnormal range, see a bias below 2**-d of a spacing) and the offset is removed after.
    """
    d = 23 - fmt.mbits
    r = uniform_int(a.shape, d, generator, a.device)
    if fmt.ebits == 8:  # e8mY: fp32's own subnormals are linear in the bits, no offset needed
        y = r.add_(a.view(torch.int32)).bitwise_and_(-(1 << d)).view(torch.float32)
        return torch.where(torch.isnan(a), a, y)
    sub = a < fmt.min_normal
    t = torch.where(sub, a + fmt.min_normal, a)
    y = r.add_(t.view(torch.int32)).bitwise_and_(-(1 << d)).view(torch.float32)
    return torch.where(sub, y - fmt.min_normal, torch.where(torch.isnan(a), a, y))


def binade_format(fmt: Format) -> bool:
    """True for the float formats that torch.compile on CPU rounds with the binade's spacing picked by
    comparisons (``rne_binades``, ``sr_binades``): 1-22 mantissa bits, subnormals, neither inf nor NaN
    (overflow always clamps), at most 8 binades (fp6: e2m3, e3m2; fp4: e2m1)."""
    return (
        isinstance(fmt, FloatFormat)
        and 1 <= fmt.mbits <= 22
        and fmt.subnormals
        and fmt.saturates_always
        and fmt.emax - fmt.emin <= 8
    )


def _spacing_by_binade(a: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """The grid spacing at magnitudes ``a`` (the subnormal spacing below 2**(emin + 1); emax's above the top
    binade, where values clamp anyway), chosen by comparisons instead of the exponent bits."""
    s = torch.full((), 2.0 ** (fmt.emin - fmt.mbits), device=a.device)
    for e in range(fmt.emin + 1, fmt.emax + 1):
        s = torch.where(a >= 2.0**e, 2.0 ** (e - fmt.mbits), s)
    return s


def rne_binades(a: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Round-half-even of magnitudes ``a`` for a ``binade_format``: ``round(a / s) * s`` with the spacing s
    of a's binade (both scalings exact: s is a power of two), the values of ``rne_magic`` (past max they
    differ, but both clamp to max). Vectorizes under inductor, where the exponent-bit tricks do not."""
    s = _spacing_by_binade(a, fmt)
    return torch.round(a / s) * s


def sr_binades(a: torch.Tensor, fmt: FloatFormat, generator) -> torch.Tensor:
    """``sr_bits`` without bit reinterpretations, for ``binade_format``s: the same values (the same random
    integers R, the same rule: up iff the discarded low bits of the fp32 pattern plus R carry), with the
    spacing of a's binade chosen by comparisons. Above the top binade the two may differ, but both are
    past max there, which such formats always clamp to. Used under torch.compile on CPU, where this
    vectorizes and the bit tricks run element by element."""
    d = 23 - fmt.mbits
    r = uniform_int(a.shape, d, generator, a.device).to(torch.float32)  # exact: R < 2**d <= 2**22
    sub = a < fmt.min_normal
    t = torch.where(sub, a + fmt.min_normal, a)  # the same fp32 offset as sr_bits
    s = _spacing_by_binade(t, fmt)
    lo = torch.floor(t / s) * s  # t rounded down to the grid: exact (power-of-two scalings)
    low = (t - lo) / s * 2.0**d  # the discarded low bits of t's fp32 pattern, as an integer
    y = lo + torch.where(low + r >= 2.0**d, s, 0.0)
    return torch.where(sub, y - fmt.min_normal, torch.where(torch.isnan(a), a, y))
