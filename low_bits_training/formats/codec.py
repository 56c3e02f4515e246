"""Bit codes of grid values (encode / decode) and sub-byte packing.

Codes are uint8 holding the format's bit pattern in the low ``bits`` bits: sign | exponent field | mantissa.
NaN encodes as the all-ones code (with the value's sign bit where the format is signed); inf as the all-ones
exponent with mantissa 0. Formats with no NaN ("finite": fp6, fp4; int) cannot encode NaN: it becomes the
code of +0 (a NaN inside a scaled group already makes that group's scale NaN, which is how OCP MX carries it).
Codebooks (``CodeFormat``: dt8, udt8): the code is the value's index in the book (``formats.codebook``).
"""

from __future__ import annotations

import torch

from .codebook import decode_code, encode_code
from .rounding import exp2i, floor_log2
from .table import CodeFormat, FloatFormat, Format, IntFormat, get_format


def _encode_float(y: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    a = y.abs()
    normal = a >= fmt.min_normal
    e = floor_log2(a).clamp_(fmt.emin, fmt.emax)
    mant = a * exp2i(fmt.mbits - e) - normal.to(torch.float32) * 2**fmt.mbits  # integer-valued
    field = torch.where(normal, e + fmt.bias, 0)
    code = (field << fmt.mbits) | mant.nan_to_num(0.0, 0.0, 0.0).to(torch.int32)
    top = 2 ** (fmt.ebits + fmt.mbits) - 1
    if fmt.has_inf:
        code = torch.where(torch.isinf(a), top - (2**fmt.mbits - 1), code)
    code = torch.where(torch.isnan(a), top if fmt.has_nan else 0, code)
    if fmt.signed:
        code = code | (torch.signbit(y).to(torch.int32) << (fmt.ebits + fmt.mbits))
    return code.to(torch.uint8)


def _decode_float(codes: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    c = codes.to(torch.int32)
    body_bits = fmt.ebits + fmt.mbits
    body = c & (2**body_bits - 1)
    field, mant = body >> fmt.mbits, (body & (2**fmt.mbits - 1)).to(torch.float32)
    sub = (field == 0) & fmt.subnormals
    e = torch.where(sub, fmt.emin, field - fmt.bias)
    v = (mant + (~sub).to(torch.float32) * 2**fmt.mbits) * exp2i(e - fmt.mbits)
    top_field = 2**fmt.ebits - 1
    if fmt.has_inf:
        v = torch.where((field == top_field) & (mant == 0), float("inf"), v)
        v = torch.where((field == top_field) & (mant != 0), float("nan"), v)
    elif fmt.has_nan:
        v = torch.where(body == 2**body_bits - 1, float("nan"), v)
    if fmt.signed:
        v = torch.where((c >> body_bits) & 1 == 1, -v, v)
    return v


def encode(y: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """Bit codes (uint8, one per element) of fp32 values that already lie on fmt's grid (name or format)."""
    fmt = get_format(fmt)
    if isinstance(fmt, IntFormat):
        return (y.nan_to_num(0.0).to(torch.int32) & (2**fmt.bits - 1)).to(torch.uint8)
    if isinstance(fmt, CodeFormat):
        return encode_code(y, fmt)
    return _encode_float(y.to(torch.float32), fmt)


def decode(codes: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """fp32 values of uint8 bit codes (the inverse of ``encode``; name or format)."""
    fmt = get_format(fmt)
    if isinstance(fmt, IntFormat):
        half = 2 ** (fmt.bits - 1)
        return (((codes.to(torch.int32) & (2**fmt.bits - 1)) ^ half) - half).to(torch.float32)
    if isinstance(fmt, CodeFormat):
        return decode_code(codes, fmt)
    return _decode_float(codes, fmt)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack codes of <= 4 bits two per byte along the flattened tensor (element 2i in the low nibble,
    2i+1 in the high nibble, the torch float4_e2m1fn_x2 convention); odd counts get a zero pad nibble.
    Wider codes are returned flattened, one per byte (fp6 stays one code per byte)."""
    flat = codes.reshape(-1)
    if bits > 4:
        return flat
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    return flat[0::2] | (flat[1::2] << 4)


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of ``pack``: flat uint8 codes, ``numel`` of them."""
    if bits > 4:
        return packed[:numel]
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(-1)[:numel]


def finite_grid_values(fmt: str | Format) -> list[float]:
    """Sorted distinct finite values of a format of <= 16 bits (every code decoded)."""
    fmt = get_format(fmt)
    if isinstance(fmt, IntFormat):
        return [float(v) for v in range(-int(fmt.max), int(fmt.max) + 1)]
    if isinstance(fmt, CodeFormat):
        return list(fmt.values)
    vals = decode(torch.arange(fmt.n_codes, dtype=torch.int32), fmt)
    return sorted(set(vals[torch.isfinite(vals)].tolist()))
