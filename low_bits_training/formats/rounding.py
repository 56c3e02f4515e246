"""Elementwise rounding of fp32 values onto a format's grid (no scaling).

Two implementations, both held bit for bit to ``reference.ref_round`` in tests:

- fast round-half-even (``_rne_magic``): one fp32 add and subtract of a per-element power of two, used for
  "nearest" on fp16, fp8, fp6, fp4 and generic eXmY; bf16 and other e8mY use integer rounding of the fp32
  bit pattern (``_rne_bits``).
- generic (every rounding mode, every format): for |x| in binade E = clamp(floor(log2|x|), emin, emax) the grid spacing is
2**(E - mbits). ``v = |x| * 2**(mbits - E)`` is exact (a power-of-two product), the grid points are the
integers, and rounding ``v`` to an integer is the whole job: ``torch.round`` (ties to even),
``torch.trunc`` (toward zero) or ``floor(v) + (u < frac(v))`` (stochastic). ``floor(log2|x|)`` is read
from the fp32 exponent field. Clamping E at emin gives the subnormal grid; clamping at emax sends
everything above the top binade past ``max``, where the overflow rule takes over.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from .random import RandomSource, uniform, uniform_int
from .table import FloatFormat, Format, IntFormat, get_format

FAST_PATHS = True
"""Use the fast nearest / stochastic paths (tests switch this off to hold the generic path to the reference)."""

NATIVE_FP8_CASTS = True
"""Eager "nearest" to e4m3 / e5m2 through torch's cast kernels (tests switch this off to test the add/sub trick)."""

Rounding = Literal["nearest", "stochastic", "toward_zero"]
ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic", "toward_zero")


def pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k as fp32 for an int32 tensor k in [-126, 127], built from the exponent field (exact)."""
    return ((k + 127) << 23).view(torch.float32)


def exp2i(k: torch.Tensor) -> torch.Tensor:
    """2**k as fp32 for int32 k in [-252, 254]: two exact normal factors (subnormal results stay exact)."""
    half = k >> 1
    return pow2(half) * pow2(k - half)


def floor_log2(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) for fp32 a >= 0 normal (int32); fp32 subnormals and 0 give -127, inf/NaN give 128."""
    return (a.view(torch.int32) >> 23) - 127


def _scale_pow2(a: torch.Tensor, k: torch.Tensor, split: bool) -> torch.Tensor:
    # a * 2**k; with split, k may run to +-252 (two normal factors keep every product exact).
    if not split:
        return a * pow2(k)
    half = k >> 1
    return a * pow2(half) * pow2(k - half)  # not a * exp2i(k): 2**k alone may not fit in fp32


def _round_int(v: torch.Tensor, rounding: str, generator: torch.Generator | None) -> torch.Tensor:
    """Round non-negative v to an integer-valued fp32 tensor (v may be overwritten)."""
    if rounding == "nearest":
        return v.round_()  # round half to even
    if rounding == "toward_zero":
        return v.trunc_()
    floor = torch.floor(v)
    u = uniform(v.shape, generator, v.device)
    return floor + (u < (v - floor)).to(torch.float32)  # v - floor is exact: P(up) = frac(v)


def _needs_split(fmt: FloatFormat) -> bool:
    return fmt.mbits - fmt.emin > 126 or fmt.mbits - fmt.emax < -126


def _round_float_magnitude(a: torch.Tensor, fmt: FloatFormat, rounding: str, generator) -> torch.Tensor:
    """Round |x| (fp32, >= 0, maybe inf/NaN) onto the grid of fmt, ignoring max (overflow handled later)."""
    e = floor_log2(a).clamp_(fmt.emin, fmt.emax)
    k = fmt.mbits - e
    split = _needs_split(fmt)
    r = _round_int(_scale_pow2(a, k, split), rounding, generator)
    return _scale_pow2(r, -k, split)


def _magic_ok(fmt: FloatFormat) -> bool:
    # Needs a < C (mbits <= 22), C finite for a up to 2**(emax+2), and a subnormal grid below emin.
    return 1 <= fmt.mbits <= 22 and fmt.subnormals and fmt.emax + 2 + 23 - fmt.mbits <= 127


def _rne_magic(a: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
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


def _bits_ok(fmt: FloatFormat) -> bool:
    # 8 exponent bits and subnormals: the format's grid is fp32's with the low 23 - mbits bits cleared.
    return fmt.ebits == 8 and fmt.subnormals and 1 <= fmt.mbits <= 23


def _rne_bits(a: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
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


def _sr_bits(a: torch.Tensor, fmt: FloatFormat, generator) -> torch.Tensor:
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
    comparisons (``_rne_binades``, ``_sr_binades``): 1-22 mantissa bits, subnormals, neither inf nor NaN
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


def _rne_binades(a: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """Round-half-even of magnitudes ``a`` for a ``binade_format``: ``round(a / s) * s`` with the spacing s
    of a's binade (both scalings exact: s is a power of two), the values of ``_rne_magic`` (past max they
    differ, but both clamp to max). Vectorizes under inductor, where the exponent-bit tricks do not."""
    s = _spacing_by_binade(a, fmt)
    return torch.round(a / s) * s


def _sr_binades(a: torch.Tensor, fmt: FloatFormat, generator) -> torch.Tensor:
    """``_sr_bits`` without bit reinterpretations, for ``binade_format``s: the same values (the same random
    integers R, the same rule: up iff the discarded low bits of the fp32 pattern plus R carry), with the
    spacing of a's binade chosen by comparisons. Above the top binade the two may differ, but both are
    past max there, which such formats always clamp to. Used under torch.compile on CPU, where this
    vectorizes and the bit tricks run element by element."""
    d = 23 - fmt.mbits
    r = uniform_int(a.shape, d, generator, a.device).to(torch.float32)  # exact: R < 2**d <= 2**22
    sub = a < fmt.min_normal
    t = torch.where(sub, a + fmt.min_normal, a)  # the same fp32 offset as _sr_bits
    s = _spacing_by_binade(t, fmt)
    lo = torch.floor(t / s) * s  # t rounded down to the grid: exact (power-of-two scalings)
    low = (t - lo) / s * 2.0**d  # the discarded low bits of t's fp32 pattern, as an integer
    y = lo + torch.where(low + r >= 2.0**d, s, 0.0)
    return torch.where(sub, y - fmt.min_normal, torch.where(torch.isnan(a), a, y))


FP8_CAST_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""torch's fp8 dtypes whose casts round exactly as this module does (tested)."""
COMPILED_CPU_CAST_DTYPES = (torch.float8_e4m3fn,)
"""The fp8 dtypes whose casts stand in under torch.compile on the CPU. torch 2.14's CPU vector library
converts e5m2 16 floats at a time only; a kernel that reads bf16 (training's activations, weights and
gradients) steps 32 at a time and converts e5m2 element by element, slower than the general route: a
1024 x 1024 e5m2 tensorwise cast of a bf16 tensor takes 0.8 ms on the general route against 1.3 ms with
the e5m2 cast (of an fp32 tensor the other way round, 1.1 against 0.5 ms; ``benchmarks/bench_formats.py
--size 1024 --reps 20 --only e5m2 [--dtype bfloat16]``). e4m3 converts 32 at a time."""


def native_fp8_dtype(fmt: Format, device: torch.device, saturate: bool = True) -> torch.dtype | None:
    """The torch fp8 dtype whose cast kernels may stand in for this package's rounding and coding of ``fmt``
    on ``device`` (nearest-even with subnormals; codes, NaN and -0 bit for bit; held to the reference and
    ml_dtypes in tests), else None. One pass each, vs ~6 for the add/sub trick. Eagerly on every device;
    under torch.compile on the CPU only, where inductor vectorizes the cast (and not the bit
    reinterpretations of the general route), and there for e4m3 only (``COMPILED_CPU_CAST_DTYPES``; which
    roundings take the round trip through the dtype: ``rounds_by_cast``). Not
    compiled for CUDA: Triton lacks fp8 on GPUs before sm89, and the general route fuses into the kernel
    there. ``saturate=False`` (overflow keeps the format's own inf / NaN) needs a format with inf: e4m3fn
    turns a value past its max into NaN, so it only stands in for saturating casts (the caller clamps
    first); e5m2 overflows to inf as ours does. The one answer for the casts (``round_to``), the optimizer's
    state codes (``optim.codec``) and the fp8 copies quantized layers keep for the backward
    (``nn.functional.stored``)."""
    dtype = getattr(fmt, "torch_dtype", None)
    if not (NATIVE_FP8_CASTS and dtype in FP8_CAST_DTYPES and (saturate or fmt.has_inf)):
        return None
    if compiling_for_cpu(device):
        return dtype if dtype in COMPILED_CPU_CAST_DTYPES else None
    return None if torch.compiler.is_compiling() else dtype


EAGER_CPU_ROUND_TRIP_DTYPES = (torch.float8_e5m2,)
"""The fp8 dtypes whose round trip (cast to fp8 and back to fp32) rounds eager CPU tensors
(``round_magnitude``). torch 2.14's CPU kernel converts e4m3 back to fp32 one element at a time (2.2 ms for
1024 x 768 against 0.3 ms for the cast to e4m3; e5m2 goes back through fp16's vector conversion, 0.3 ms), so
eager e4m3 takes the add/sub trick (0.7 ms for the whole rounding). Compiled, inductor converts both ways
in vector registers and e4m3 keeps the cast (``COMPILED_CPU_CAST_DTYPES``)."""


E4M3_CAST_SATURATES = bool(torch.tensor(1e4).to(torch.float8_e4m3fn).float() == 448.0)
"""Whether this torch's float8_e4m3fn cast saturates a value past 448 (torch 2.13 on), or makes it NaN
(torch 2.11 and 2.12: ``scripts/torch_range.sh``, docs/speed_model.md "Which torch"). Where it does not, a
saturating rounding does not take the cast (``rounds_by_cast``)."""


def rounds_by_cast(fmt: Format, device: torch.device, saturate: bool = True) -> bool:
    """True when ``round_magnitude`` rounds to ``fmt`` by a round trip through its torch fp8 dtype
    (``native_fp8_dtype``), except eagerly on the CPU for the dtypes whose way back is slow there
    (``EAGER_CPU_ROUND_TRIP_DTYPES``), and for e4m3 on a torch whose cast does not saturate
    (``E4M3_CAST_SATURATES``). The values are the same either way (tested)."""
    dtype = native_fp8_dtype(fmt, device, saturate)
    if dtype == torch.float8_e4m3fn and not E4M3_CAST_SATURATES:
        return False
    if dtype is None or torch.compiler.is_compiling() or device.type != "cpu":
        return dtype is not None
    return dtype in EAGER_CPU_ROUND_TRIP_DTYPES


def threshold_format(fmt: Format) -> bool:
    """True for formats whose codes the optimizer's codec finds by counting thresholds
    (``nearest_thresholds``; ``optim.codec``): signed float formats of <= 4 bits with subnormals and
    neither inf nor NaN (fp4: e2m1)."""
    return (
        isinstance(fmt, FloatFormat)
        and fmt.bits <= 4
        and fmt.signed
        and fmt.subnormals
        and not (fmt.has_inf or fmt.has_nan)
    )


def nearest_thresholds(fmt: FloatFormat) -> list[tuple[int, float, float]]:
    """(code, midpoint, step) for each non-negative grid value above 0 of a ``threshold_format``: a magnitude
    above the midpoint between it and the value below (at it, when the code is even: ties to even) rounds
    to it or higher; ``step`` is the gap to the value below. Plain Python, so constants when traced."""

    def value(c: int) -> float:
        field, mant = c >> fmt.mbits, c & (2**fmt.mbits - 1)
        sig = mant << 1 if field == 0 else (mant | 2**fmt.mbits) << field
        return math.ldexp(sig, -(fmt.bias + fmt.mbits))

    codes = [c for c in range(1, 2 ** (fmt.bits - 1)) if value(c) <= fmt.max]
    return [(c, (value(c - 1) + value(c)) / 2, value(c) - value(c - 1)) for c in codes]


def compiling_for_cpu(device: torch.device) -> bool:
    """True while torch.compile traces code for a CPU tensor (inductor's C++ backend: where bit
    reinterpretations run element by element and the fp8 casts vectorize)."""
    return device.type == "cpu" and torch.compiler.is_compiling()


def _overflow(y: torch.Tensor, fmt: Format, saturate: bool) -> torch.Tensor:
    """Apply the overflow rule to a rounded magnitude y (NaN stays NaN)."""
    if saturate or fmt.saturates_always:
        return y.clamp_max_(fmt.max)  # clamp propagates NaN
    # a Python scalar, not a tensor made per call (no host-to-device copy in a captured CUDA graph)
    return torch.where(y > fmt.max, float("inf") if fmt.has_inf else float("nan"), y)


def _unsigned_fixups(y: torch.Tensor, x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    # Unsigned scale formats: negatives are not representable (NaN, like ml_dtypes); e8m0 has no zero,
    # so anything below its smallest value becomes 2**-127 (like torch's float8_e8m0fnu cast).
    if not fmt.has_zero:
        y = torch.clamp_min(y, fmt.min_normal)
    return torch.where(x < 0, float("nan"), y)


def round_magnitude(a: torch.Tensor, fmt: Format, rounding: str, saturate: bool, generator=None):
    """Round fp32 magnitudes a >= 0 onto fmt's grid and apply the overflow rule (a may be overwritten)."""
    if isinstance(fmt, IntFormat):
        y = _round_int(a, rounding, generator)
    elif rounding == "nearest" and FAST_PATHS and rounds_by_cast(fmt, a.device, saturate):
        y = a.to(fmt.torch_dtype).to(torch.float32)
    elif rounding == "nearest" and FAST_PATHS and binade_format(fmt) and compiling_for_cpu(a.device):
        y = _rne_binades(a, fmt)
    elif rounding == "nearest" and FAST_PATHS and _magic_ok(fmt):
        y = _rne_magic(a, fmt)
    elif rounding == "nearest" and FAST_PATHS and _bits_ok(fmt):
        y = _rne_bits(a, fmt)
    elif rounding == "stochastic" and FAST_PATHS and binade_format(fmt) and compiling_for_cpu(a.device):
        y = _sr_binades(a, fmt, generator)
    elif rounding == "stochastic" and FAST_PATHS and 1 <= fmt.mbits <= 22 and fmt.subnormals:
        y = _sr_bits(a, fmt, generator)
    else:
        y = _round_float_magnitude(a, fmt, rounding, generator)
    return _overflow(y, fmt, saturate)


def round_to(
    x: torch.Tensor,
    fmt: str | Format,
    rounding: Rounding = "nearest",
    saturate: bool = True,
    generator: RandomSource = None,
) -> torch.Tensor:
    """Round every element of x to the nearest (or stochastically chosen) value of a format; no scaling.

    Args:
        x: fp32, bf16 or fp16 tensor (computed in fp32).
        fmt: format name or object (see ``get_format``).
        rounding: ``"nearest"`` (ties to even), ``"stochastic"`` (unbiased, P(up) = distance to the lower
            neighbour / spacing, from ``torch.rand(generator=generator)``), ``"toward_zero"``.
        saturate: overflow clamps to +-max; False: overflow (after rounding) gives inf where the format has
            inf (e5m2, fp16, bf16), NaN where it has only NaN (e4m3, e8m0), and still clamps where it has
            neither (fp6, fp4, int). NaN in gives NaN out; +-inf in gives +-max when saturating.
        generator: random source for stochastic rounding: a ``torch.Generator`` (same state -> same result),
            an int64 key tensor (counter-based bits, ``formats.random``: the same eager and compiled), or
            None (torch's global RNG).

    Returns:
        Tensor of x's shape and dtype. For bf16/fp16 input the fp32 result is cast back (RNE): exact
        for every format whose values the input dtype can hold (all formats with <= 7 mantissa bits for bf16).

    Raises:
        ValueError: unknown format or rounding.
    """
    fmt = get_format(fmt)
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding={rounding!r} is not one of {ROUNDINGS}")
    xf = x.to(torch.float32)
    return round_signed_(xf.abs(), xf, fmt, rounding, saturate, generator).to(x.dtype)


def round_signed_(
    a: torch.Tensor, sign: torch.Tensor, fmt: Format, rounding: str, saturate: bool, generator=None
):
    """Round magnitudes ``a`` (fp32, overwritten: pass a tensor you own) and give them the signs of ``sign``.

    The in-place form of ``round_to`` used by the scaled paths: ``a = (x / scale).abs_()``, ``sign = x``.
    """
    y = round_magnitude(a, fmt, rounding, saturate, generator).copysign_(sign)
    if not fmt.signed:
        y = _unsigned_fixups(y.abs_(), sign, fmt)
    return y
