"""Store an fp32 state tensor in a state format: native dtype, or codes + scales laid out row by row.

Layout of a quantized state of a parameter shard of shape (*lead, cols), blocks of ``bs`` along the last dim:

- ``<name>_codes``: uint8 (*lead, cols // per_byte); per_byte = 2 for formats of <= 4 bits (two codes a byte,
  the pair never straddles rows because ``bs`` is even), 1 otherwise.
- ``<name>_scales``: (*lead, cols // bs) in the scale format's storage: fp32 / bf16 values, or the uint8
  codes of e8m0 / ue4m3.

Both have the parameter's leading dims, so a ``Shard(0)`` placement of the parameter carries over to them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from low_bits_training.formats import QuantSpec, decode, encode, get_format, quantize, round_to, unpack

from .presets import NATIVE

_NATIVE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@functools.cache
def _lut(fmt: str, device: torch.device) -> torch.Tensor:
    """fp32 value of every code of an (<= 8-bit) format: decoding becomes one gather. Held to
    ``formats.dequantize`` bit for bit in tests/optim/test_codec.py."""
    f = get_format(fmt)
    return decode(torch.arange(2**f.bits, dtype=torch.uint8, device=device), f)


def lut_decode(codes: torch.Tensor, fmt: str) -> torch.Tensor:
    """fp32 values of uint8 codes (same shape) by table lookup."""
    return _lut(fmt, codes.device)[codes.long()]


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

    def fits(self, shape: tuple[int, ...]) -> bool:
        """True when a local shard of ``shape`` can be stored under this codec's layout."""
        if self.native or self.spec.scaling == "none":
            return len(shape) >= 1 and shape[-1] % self.per_byte == 0
        bs = self.spec.block_size
        return len(shape) >= 1 and shape[-1] % bs == 0 and bs % self.per_byte == 0

    def part_shapes(self, shape: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """Suffix -> shape of each stored tensor for a tensor of ``shape`` (local or global alike)."""
        lead, cols = tuple(shape[:-1]), shape[-1]
        if self.native:
            return {"": tuple(shape)}
        parts = {"_codes": (*lead, cols // self.per_byte)}
        if self.spec.scaling == "block":
            parts["_scales"] = (*lead, cols // self.spec.block_size)
        return parts

    def _scale_dtype(self) -> torch.dtype:
        sf = self.spec.scale_format
        return _NATIVE_DTYPES.get(sf, torch.uint8)

    def encode(self, x: torch.Tensor, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
        """Quantize fp32 ``x`` (*lead, cols) into its stored parts (suffix -> tensor)."""
        if self.native:
            if self.spec.format == "fp32":
                return {"": x.to(torch.float32)}
            y = round_to(x.float(), self.spec.format, self.spec.rounding, self.spec.saturate, generator)
            return {"": y.to(_NATIVE_DTYPES[self.spec.format])}
        q = quantize(x.float(), self.spec, generator)
        shapes = self.part_shapes(tuple(x.shape))
        parts = {"_codes": q.codes.reshape(shapes["_codes"])}
        if self.spec.scaling == "block":
            s = q.scales.reshape(shapes["_scales"])
            sf = self.spec.scale_format
            parts["_scales"] = s.to(_NATIVE_DTYPES[sf]) if sf in _NATIVE_DTYPES else encode(s, sf)
        return parts

    def decode(self, parts: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        """fp32 values (``shape``) of stored parts (the inverse of ``encode`` up to rounding)."""
        if self.native:
            return parts[""].to(torch.float32, copy=True)  # callers update it in place
        lead, cols = tuple(shape[:-1]), shape[-1]
        numel = cols * (torch.Size(lead).numel())
        y = lut_decode(
            unpack(parts["_codes"].reshape(-1), get_format(self.spec.format).bits, numel), self.spec.format
        )
        if self.spec.scaling != "block":
            return y.reshape(shape)
        s = parts["_scales"]
        s = s.float() if self.spec.scale_format in _NATIVE_DTYPES else lut_decode(s, self.spec.scale_format)
        return (y.reshape(*lead, cols // self.spec.block_size, -1) * s.unsqueeze(-1)).reshape(shape)

    def dtypes(self) -> dict[str, torch.dtype]:
        """Suffix -> storage dtype of each part."""
        if self.native:
            return {"": _NATIVE_DTYPES[self.spec.format]}
        d = {"_codes": torch.uint8}
        if self.spec.scaling == "block":
            d["_scales"] = self._scale_dtype()
        return d
