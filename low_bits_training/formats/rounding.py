"""Elementwise rounding of fp32 values onto a format's grid (no scaling).

Three kinds of route, all held bit for bit to ``reference.ref_round`` in tests:

- torch's own fp8 casts, where they stand in (``native.rounds_by_cast``): a round trip through the dtype.
- fast paths (``fast_round``): round-half-even by one fp32 add and subtract of a per-element power of two
  (``rne_magic``), used for "nearest" on fp16, fp8, fp6, fp4 and generic eXmY; bf16 and other e8mY use integer
  rounding of the fp32 bit pattern (``rne_bits``); stochastic rounding on the bit pattern (``sr_bits``).
- generic (every rounding mode, every format), here: for |x| in binade E = clamp(floor(log2|x|), emin, emax) the grid spacing is
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

from .codebook import round_code
from .fast_round import (
    binade_format,
    bits_ok,
    magic_ok,
    rne_binades,
    rne_bits,
    rne_magic,
    sr_binades,
    sr_bits,
)
from .native import compiling_for_cpu, rounds_by_cast
from .random import RandomSource, uniform
from .table import CodeFormat, FloatFormat, Format, IntFormat, get_format

FAST_PATHS = True
"""Use the fast nearest / stochastic paths (tests switch this off to hold the generic path to the reference)."""


Rounding = Literal["nearest", "stochastic", "toward_zero"]
ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic", "toward_zero")


def pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k as fp32 for an int32 tensor k in [-126, 127], built from the exponent field (exact)."""
    return ((k + 127) << 23).view(torch.float32)


def exp2i(k: torch.Tensor) -> torch.Tensor:
    """2**k as fp32 for int32 k in [-252, 254]: two exact normal factors (subnormal results stay exact)."""
    half = k >> 1
    return pow2(half) * pow2(k - half)


def div_rn(a: torch.Tensor, c: float) -> torch.Tensor:
    """fl32(a / c) for fp32 ``a`` and a Python number ``c``: the correctly rounded quotient on every device,
    eager or compiled.

    ``a / c`` alone is not: CUDA's eager kernel divides by a CPU scalar as ``a x fl(1 / c)`` (ATen's
    ``div_true_kernel_cuda``), and inductor lowers a division by a constant to that product on GPUs
    (``div_prim``); one fp32 ulp off for some ``a`` (the GPU check of 2026-11-28 on an H200: block scales
    ``amax / 448`` of deepseek_fp8, ``amax / 6`` of NVFP4, ``amax / 127`` of int8, CUDA against the CPU). In
    float64 either form rounds to the true fp32 quotient: the reciprocal product errs by about 2**-52 of the
    quotient, and an fp32 quotient by c = odd x 2**k (odd < 2**12) is never within 2**-37 of an fp32
    midpoint (``tests/formats/test_rounding_div.py``). MPS has no float64: the plain quotient there."""
    if a.device.type == "mps":
        return a / c
    return (a.double() / c).float()


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
        y = rne_binades(a, fmt)
    elif rounding == "nearest" and FAST_PATHS and magic_ok(fmt):
        y = rne_magic(a, fmt)
    elif rounding == "nearest" and FAST_PATHS and bits_ok(fmt):
        y = rne_bits(a, fmt)
    elif rounding == "stochastic" and FAST_PATHS and binade_format(fmt) and compiling_for_cpu(a.device):
        y = sr_binades(a, fmt, generator)
    elif rounding == "stochastic" and FAST_PATHS and 1 <= fmt.mbits <= 22 and fmt.subnormals:
        y = sr_bits(a, fmt, generator)
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
    if isinstance(fmt, CodeFormat):  # a codebook: signed search, saturating (``formats.codebook``)
        return round_code(a.copysign_(sign), fmt, rounding, generator)
    y = round_magnitude(a, fmt, rounding, saturate, generator).copysign_(sign)
    if not fmt.signed:
        y = _unsigned_fixups(y.abs_(), sign, fmt)
    return y
