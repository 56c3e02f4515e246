"""Numerics core: every low-bit format as data, rounding onto its grid, scaling, (fake) quantization.

Pure functions of tensors (torch only). See docs/formats.md.
"""

from .codec import decode, encode, finite_grid_values, pack, unpack
from .quant import (
    Factored,
    QuantizedTensor,
    dequantize,
    factored_quantize,
    fake_quantize,
    has_outer_scale,
    quantize,
    split_scale,
)
from .random import RandomSource, derive_key, fold_key, random_bits, uniform, uniform_int
from .rounding import ROUNDINGS, round_to
from .scaling import (
    GroupScales,
    check_divisible,
    compute_scales,
    group_amax,
    group_scales,
    grouped_shape,
    in_scale_units,
    scale_from_amax,
)
from .spec import HIGH, SCALE_FORMATS, QuantSpec
from .table import ALIASES, FORMATS, CodeFormat, FloatFormat, Format, IntFormat, get_format

__all__ = [
    "HIGH",
    "ALIASES",
    "FORMATS",
    "ROUNDINGS",
    "SCALE_FORMATS",
    "CodeFormat",
    "Factored",
    "FloatFormat",
    "Format",
    "GroupScales",
    "IntFormat",
    "QuantSpec",
    "QuantizedTensor",
    "RandomSource",
    "check_divisible",
    "compute_scales",
    "decode",
    "derive_key",
    "dequantize",
    "encode",
    "factored_quantize",
    "fake_quantize",
    "finite_grid_values",
    "fold_key",
    "get_format",
    "group_amax",
    "group_scales",
    "in_scale_units",
    "grouped_shape",
    "has_outer_scale",
    "pack",
    "quantize",
    "random_bits",
    "round_to",
    "scale_from_amax",
    "split_scale",
    "uniform",
    "uniform_int",
    "unpack",
]
