"""Store an fp32 state tensor in a state format: native dtype, or codes + scales laid out row by row.

Layout of a quantized state of a parameter shard of shape (*lead, cols), blocks of ``bs`` along the last dim:

- ``<name>_codes``: uint8 (*lead, cols // per_byte); per_byte = 2 for formats of <= 4 bits (two codes a byte,
  the pair never straddles rows because ``bs`` is even), 1 otherwise.
- ``<name>_scales``: (*lead, cols // bs) in the scale format's storage: fp32 / bf16 values, or the uint8
  codes of e8m0 / ue4m3.

Both have the parameter's leading dims, so a ``Shard(0)`` placement of the parameter carries over to them.
Since blocks never cross a row, the flattened shard is a run of whole blocks: ``encode`` / ``decode`` take any
(rows, k * bs) view of it (the optimizer passes row chunks of its flat view).

The numerics are ``formats``' (block scale, element rounding, bit codes: ``encode`` equals
``formats.quantize`` bit for bit, tested). Two steps are written here in ops that vectorize under
torch.compile, where the ``formats`` versions would make inductor fall back to scalar C++ loops: the bit
codes of values already on the grid (``grid_codes``) and the bf16 cast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from low_bits_training.formats import (
    QuantSpec,
    decode,
    encode,
    get_format,
    group_scales,
    in_scale_units,
    round_to,
)
from low_bits_training.formats.codebook import code_indices
from low_bits_training.formats.constants import kept
from low_bits_training.formats.native import native_fp8_dtype
from low_bits_training.formats.rounding import nearest_thresholds, round_signed_, threshold_format
from low_bits_training.formats.table import CodeFormat, FloatFormat, Format, IntFormat
from low_bits_training.upstream import unset_fake_temporarily

from .presets import NATIVE

_NATIVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def store_scales(scale: torch.Tensor, scale_format: str) -> torch.Tensor:
    """Scales (on ``scale_format``'s grid) as stored: fp32 / bf16 / fp16 as that dtype, e8m0 / ue4m3 / any
    other format as its one-byte codes; exact either way."""
    dtype = _NATIVE_DTYPES.get(scale_format)
    return scale.to(dtype) if dtype is not None else encode(scale, scale_format)


def read_scales(stored: torch.Tensor, scale_format: str) -> torch.Tensor:
    """fp32 scales of what ``store_scales`` stored."""
    return stored.float() if scale_format in _NATIVE_DTYPES else decode_codes(stored, scale_format)


_LUTS: dict[tuple[str, torch.device], torch.Tensor] = {}


def _lut(fmt: str, device: torch.device) -> torch.Tensor:
    """fp32 value of every code of an (<= 8-bit) format: eager decoding becomes one gather (kept:
    ``formats.constants.kept``)."""
    f = get_format(fmt)
    return kept(
        _LUTS, (fmt, device), lambda: decode(torch.arange(2**f.bits, dtype=torch.uint8, device=device), f)
    )


def _small_float(fmt: Format) -> bool:
    # Float formats whose values are (integer significand << exponent field) * 2**-(bias + mbits) in int32.
    return isinstance(fmt, FloatFormat) and fmt.signed and fmt.subnormals and fmt.ebits <= 4


def _decode_small(codes: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """``formats.decode`` of a ``_small_float`` format in integer shifts and one exact multiply (no bit
    reinterpretation, which inductor's CPU code does element by element)."""
    c = codes.to(torch.int32)
    body_bits = fmt.ebits + fmt.mbits
    body = c & (2**body_bits - 1)
    field, mant = body >> fmt.mbits, body & (2**fmt.mbits - 1)
    sig = torch.where(field == 0, mant << 1, (mant | 2**fmt.mbits) << field)  # value * 2**(bias + mbits)
    v = sig.to(torch.float32) * 2.0 ** -(fmt.bias + fmt.mbits)
    top_field = 2**fmt.ebits - 1
    if fmt.has_inf:
        v = torch.where(field == top_field, torch.where(mant == 0, math.inf, math.nan), v)
    elif fmt.has_nan:
        v = torch.where(body == 2**body_bits - 1, math.nan, v)
    return torch.where(((c >> body_bits) & 1) == 1, -v, v)


def decode_codes(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values of uint8 codes (same shape), equal to ``formats.decode`` (tested): the fp8 dtype's cast
    where ``native_fp8_dtype`` allows it; otherwise a table lookup eagerly, integer arithmetic under
    torch.compile (a gather does not vectorize there)."""
    f = get_format(fmt)
    dtype = native_fp8_dtype(f, codes.device)
    if dtype is not None:
        return codes.view(dtype).to(torch.float32)
    if not torch.compiler.is_compiling():
        return _lut(fmt, codes.device)[codes.long()]
    return _decode_small(codes, f) if _small_float(f) else decode(codes, f)


def nearest_codes(q: torch.Tensor, sign: torch.Tensor, fmt: Format, saturate: bool) -> torch.Tensor | None:
    """uint8 codes of ``q`` (fp32 values divided by their scale; ``sign``: the values) rounded to nearest-even
    on ``fmt``'s grid, by a route that vectorizes where the general one (``round_signed_`` + ``grid_codes``)
    does not; None when ``fmt`` has none. Equal to ``formats.quantize``'s codes bit for bit (tested, NaN, inf
    and -0 included).

    fp8: the dtype's cast (where ``native_fp8_dtype`` allows it). Float formats of <= 4 bits without NaN or inf
    (fp4): the magnitude's code is the number of rounding thresholds (midpoints of neighbouring grid values) it
    passes, a tie going to the even code; a NaN passes none (code +-0, as ``formats.encode`` gives formats
    without NaN). Codebooks (dt8): their own search (``formats.codebook``, ties up as bitsandbytes does).
    """
    if isinstance(fmt, CodeFormat):
        return code_indices(q.copysign(sign), fmt).to(torch.uint8)
    dtype = native_fp8_dtype(fmt, q.device, saturate)
    if dtype is not None:
        q = (q.clamp(-fmt.max, fmt.max) if saturate else q).copysign(sign)  # a NaN takes the value's sign
        return q.to(dtype).view(torch.uint8)
    if not (threshold_format(fmt) and (saturate or fmt.saturates_always)):
        return None
    a = q.abs()
    code = torch.zeros_like(a, dtype=torch.int32)
    for upper, mid, _ in nearest_thresholds(fmt):
        code = code + (a >= mid if upper % 2 == 0 else a > mid).to(torch.int32)
    return (code | (torch.signbit(sign).to(torch.int32) << (fmt.bits - 1))).to(torch.uint8)


def grid_codes(y: torch.Tensor, fmt: Format) -> torch.Tensor:
    """uint8 codes of fp32 values already on ``fmt``'s grid: ``formats.encode(y, fmt)`` bit for bit (tested
    for every code, NaN and -0 included), in ops that vectorize under torch.compile.

    Integers: the low bits of the value. Signed float formats with subnormals (fp8, fp6, fp4, eXmY): the
    exponent and top mantissa bits of the fp32 bit pattern, or |y| / min_subnormal below the normal range
    (integer ops only: no fp8 dtype, which Triton lacks on older GPUs). Anything else (codebooks included):
    ``formats.encode``.
    """
    if isinstance(fmt, IntFormat):
        return (torch.where(y == y, y, 0.0).to(torch.int32) & (2**fmt.bits - 1)).to(torch.uint8)
    if isinstance(fmt, CodeFormat) or not (fmt.signed and fmt.subnormals) or fmt.mbits == 0:
        return encode(y, fmt)
    a = y.abs()
    bits = a.view(torch.int32)
    field = (bits >> 23) - (127 - fmt.bias)
    normal = (field << fmt.mbits) | ((bits >> (23 - fmt.mbits)) & (2**fmt.mbits - 1))
    sub = (a * math.ldexp(1.0, fmt.mbits - fmt.emin)).to(
        torch.int32
    )  # exact: a is a multiple of min_subnormal
    code = torch.where(a < fmt.min_normal, sub, normal)
    top = 2 ** (fmt.ebits + fmt.mbits) - 1
    if fmt.has_inf:
        code = torch.where(a == math.inf, top - (2**fmt.mbits - 1), code)
    code = torch.where(a != a, top if fmt.has_nan else 0, code)  # NaN; a != a vectorizes, isnan does not
    sign = (y.view(torch.int32) >> 31) & 1
    return (code | (sign << (fmt.ebits + fmt.mbits))).to(torch.uint8)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``formats.pack`` of each row of (n, k) codes (k even): (n, k // 2) bytes, element 2i in the low nibble.

    Written per row (a static pair index) because the flat form gives inductor index arithmetic (division,
    modulo by the dynamic row count) that it cannot vectorize; equal to ``formats.pack`` (tested).
    """
    if bits > 4:
        return codes
    pairs = codes.reshape(codes.shape[0], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_rows``: (n, k // 2) bytes -> (n, k) codes."""
    if bits > 4:
        return packed
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def native_round(x: torch.Tensor, spec: QuantSpec, key: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` rounded to a natively stored format (fp32 / bf16 / fp16, ``spec.scaling == "none"``), in that
    dtype: ``formats.round_to`` then a cast. Nearest saturating rounding is torch's round-half-even cast of
    the clamped value, the same numbers and faster compiled (round_to's bit trick uses isnan)."""
    dtype = _NATIVE_DTYPES[spec.format]
    if spec.format == "fp32":
        return x.to(torch.float32)
    if spec.rounding == "nearest" and spec.saturate:
        m = spec.elem.max
        return x.float().clamp(-m, m).to(dtype)
    return round_to(x.float(), spec.format, spec.rounding, spec.saturate, key).to(dtype)


@dataclass(frozen=True)
class StateCodec:
    """Encoder/decoder of one state under ``spec`` (see the module docstring for the layout)."""

    spec: QuantSpec

    @property
    def native(self) -> bool:
        return self.spec.format in NATIVE

    @property
    def per_byte(self) -> int:
        return 2 if get_format(self.spec.format).bits <= 4 else 1

    @property
    def group(self) -> int:
        """Elements that must stay together in a row chunk: one block (or one code byte, or 1 native)."""
        if self.native:
            return 1
        return self.spec.block_size if self.spec.scaling == "block" else self.per_byte

    def fits(self, shape: tuple[int, ...]) -> bool:
        """True when a local shard of ``shape`` can be stored under this codec's layout."""
        if self.native or self.spec.scaling == "none":
            return len(shape) >= 1 and shape[-1] % self.per_byte == 0
        bs = self.spec.block_size
        return len(shape) >= 1 and shape[-1] % bs == 0 and bs % self.per_byte == 0

    def part_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Suffix -> shape of each stored tensor for a tensor of ``shape`` (local or global alike)."""
        if self.native:
            return {"": tuple(shape)}  # a 0-d parameter (a learned scalar) is always native
        lead, cols = tuple(shape[:-1]), shape[-1]
        parts = {"_codes": (*lead, cols // self.per_byte)}
        if self.spec.scaling == "block":
            parts["_scales"] = (*lead, cols // self.spec.block_size)
        return parts

    def dtypes(self) -> dict[str, torch.dtype]:
        """Suffix -> storage dtype of each part."""
        if self.native:
            return {"": _NATIVE_DTYPES[self.spec.format]}
        d = {"_codes": torch.uint8}
        if self.spec.scaling == "block":
            d["_scales"] = _NATIVE_DTYPES.get(self.spec.scale_format, torch.uint8)
        return d

    def encode(self, x: torch.Tensor, key: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Quantize fp32 ``x`` (*lead, cols) into its stored parts (suffix -> tensor).

        Args:
            x: the values; its last dim holds whole blocks.
            key: int64 key tensor for stochastic rounding (counter-based bits, ``formats.random``).
        """
        if self.native:
            return {"": native_round(x, self.spec, key)}
        spec = self.spec
        xg = x.reshape(-1, spec.block_size if spec.scaling == "block" else x.shape[-1]).float()
        scale = group_scales(xg, spec, (1,)).scale if spec.scaling == "block" else None  # (blocks, 1)
        q = xg if scale is None else in_scale_units(xg, scale, spec)
        codes = nearest_codes(q, xg, spec.elem, spec.saturate) if spec.rounding == "nearest" else None
        if codes is None:
            y = round_signed_(q.abs(), xg, spec.elem, spec.rounding, spec.saturate, key)
            codes = grid_codes(y, spec.elem)
        shapes = self.part_shapes(tuple(x.shape))
        parts = {"_codes": pack_rows(codes, spec.elem.bits).reshape(shapes["_codes"])}
        if scale is not None:
            parts["_scales"] = store_scales(scale.reshape(shapes["_scales"]), spec.scale_format)
        return parts

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """fp32 values (``shape``) of stored parts (the inverse of ``encode`` up to rounding); a new tensor."""
        if self.native:
            return parts[""].to(torch.float32, copy=True)  # callers may update it in place
        spec = self.spec
        codes = parts["_codes"]
        y = decode_codes(unpack_rows(codes.reshape(-1, codes.shape[-1]), spec.elem.bits), spec.format)
        if spec.scaling != "block":
            return y.reshape(shape)
        s = read_scales(parts["_scales"], spec.scale_format)
        return (y.reshape(-1, spec.block_size) * s.reshape(-1, 1)).reshape(shape)

    def zeros(self, shape: tuple[int, ...], device: torch.device) -> dict[str, torch.Tensor]:
        """The stored parts of an all-zero state of ``shape``, made without any fp32 tensor of that size.

        Every block of zeros encodes alike (one code, one scale), so one block is encoded and its first byte
        (or value) fills each part.
        """
        if self.native:
            return {"": torch.zeros(shape, dtype=_NATIVE_DTYPES[self.spec.format], device=device)}
        with unset_fake_temporarily():  # one real block on the CPU, also under the memory planner's fake mode
            one = {
                s: (v.reshape(-1)[0].item(), v.dtype)
                for s, v in self.encode(torch.zeros(1, self.group)).items()
            }
        return {
            s: torch.full(shp, one[s][0], dtype=one[s][1], device=device)
            for s, shp in self.part_shapes(tuple(shape)).items()
        }
