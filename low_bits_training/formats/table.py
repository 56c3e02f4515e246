"""Number formats as data: one frozen dataclass per kind, one table of instances.

Modelled on gfloat's ``FormatInfo``: a format is described by a few fields and every other property
(bias, emax, max normal, min subnormal, number of codes, ...) is derived from them, never written down twice.

Special-value conventions (``specials``):

- ``"ieee"``: the all-ones exponent field is reserved for inf (mantissa 0) and NaN (mantissa != 0).
  fp32, bf16, fp16, e5m2.
- ``"fn"``: no inf; only the all-ones code (exponent and mantissa all ones) is NaN, so the top binade
  holds normal numbers (OCP FP8 E4M3 "fn", e8m0, ue4m3).
- ``"finite"``: no inf, no NaN; every code is a number (OCP MX v1.0 FP6 E3M2/E2M3, FP4 E2M1).

Names ``eXmY`` that are not in the table (e3m4, e2m5, e4m4, ...) are parsed as IEEE 754-like formats:
signed, bias 2**(X-1)-1, subnormals, the all-ones exponent field reserved for inf/NaN. This is
ml_dtypes' convention for its float8_e3m4 and float8_e4m3 (non-"fn"); the OCP-named formats in the table
(e4m3 "fn", fp6, fp4) keep their own OCP conventions.

A third kind, ``CodeFormat`` (defined in ``formats.codebook`` with its rounding), is a codebook: 2**bits sorted
values in [-1, 1] and no bit structure; a code is the index of its value. "dt8" / "udt8" are the dynamic-tree
8-bit maps of bitsandbytes' and torchao's 8-bit optimizers (``codebook.dynamic_tree_values``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal

import torch

from .codebook import CodeFormat, dynamic_tree_values

Specials = Literal["ieee", "fn", "finite"]


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format with ``ebits`` exponent and ``mbits`` mantissa bits.

    Attributes:
        name: canonical name, e.g. ``"e4m3"``.
        ebits: exponent field width.
        mbits: mantissa (trailing significand) field width.
        specials: ``"ieee"`` | ``"fn"`` | ``"finite"`` (see module docstring).
        signed: False for unsigned scale formats (e8m0, ue4m3): negative inputs give NaN.
        subnormals: False for e8m0: exponent field 0 is then an ordinary binade and there is no zero.
        torch_dtype: the torch dtype with exactly this grid, if any (used for a native-cast fast path).
    """

    name: str
    ebits: int
    mbits: int
    specials: Specials = "ieee"
    signed: bool = True
    subnormals: bool = True
    torch_dtype: torch.dtype | None = None

    @property
    def kind(self) -> str:
        return "float"

    @property
    def bits(self) -> int:
        """Storage width of one code (sign + exponent + mantissa)."""
        return int(self.signed) + self.ebits + self.mbits

    @property
    def n_codes(self) -> int:
        return 2**self.bits

    @property
    def bias(self) -> int:
        return 2 ** (self.ebits - 1) - 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal binade (exponent field 1, or 0 without subnormals)."""
        return 1 - self.bias if self.subnormals else -self.bias

    @property
    def emax(self) -> int:
        """Exponent of the largest finite binade."""
        top_field = 2**self.ebits - 1
        reserved = self.specials == "ieee" or (self.specials == "fn" and self.mbits == 0)
        return top_field - self.bias - int(reserved)

    @property
    def max(self) -> float:
        """Largest finite value (max normal)."""
        top_mantissa = 2**self.mbits - 1
        if self.specials == "fn" and self.mbits > 0 and self.emax == 2**self.ebits - 1 - self.bias:
            top_mantissa -= 1  # the all-ones code of the top binade is NaN
        return math.ldexp(1 + top_mantissa / 2**self.mbits, self.emax)

    @property
    def max_step(self) -> float:
        """The gap between ``max`` and the next value below it (the grid step of the top binade)."""
        return math.ldexp(1.0, self.emax - self.mbits)

    @property
    def min_normal(self) -> float:
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value (equals ``min_normal`` without subnormals)."""
        return math.ldexp(1.0, self.emin - self.mbits) if self.subnormals else self.min_normal

    @property
    def has_inf(self) -> bool:
        return self.specials == "ieee"

    @property
    def has_nan(self) -> bool:
        return self.specials != "finite"

    @property
    def has_zero(self) -> bool:
        return self.subnormals

    @property
    def saturates_always(self) -> bool:
        """No inf and no NaN to overflow to: overflow clamps to +-max whatever ``saturate`` says."""
        return self.specials == "finite"

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class IntFormat:
    """A symmetric signed integer format: values -max..max with max = 2**(bits-1) - 1 (int8: +-127).

    The most negative two's-complement code (-128 for int8) is never produced. There is no inf or NaN;
    overflow always clamps to +-max.
    """

    name: str
    bits: int
    signed: bool = True

    @property
    def kind(self) -> str:
        return "int"

    @property
    def n_codes(self) -> int:
        return 2**self.bits

    @property
    def max(self) -> float:
        return float(2 ** (self.bits - 1) - 1)

    max_step = 1.0
    """The gap between ``max`` and the next value below it."""

    @property
    def emax(self) -> int:
        """floor(log2(max)): the power-of-two exponent used by power-of-two (MX-style) scaling."""
        return int(math.floor(math.log2(self.max)))

    @property
    def min_subnormal(self) -> float:
        return 1.0

    has_inf = False
    has_nan = False
    saturates_always = True

    def __str__(self) -> str:
        return self.name


Format = FloatFormat | IntFormat | CodeFormat

_TABLE: tuple[Format, ...] = (
    FloatFormat("fp32", 8, 23, "ieee", torch_dtype=torch.float32),
    FloatFormat("bf16", 8, 7, "ieee", torch_dtype=torch.bfloat16),
    FloatFormat("fp16", 5, 10, "ieee", torch_dtype=torch.float16),
    FloatFormat("e5m2", 5, 2, "ieee", torch_dtype=torch.float8_e5m2),
    FloatFormat("e4m3", 4, 3, "fn", torch_dtype=torch.float8_e4m3fn),
    FloatFormat("e3m2", 3, 2, "finite"),
    FloatFormat("e2m3", 2, 3, "finite"),
    FloatFormat("e2m1", 2, 1, "finite"),
    FloatFormat("e8m0", 8, 0, "fn", signed=False, subnormals=False),
    FloatFormat("ue4m3", 4, 3, "fn", signed=False),
    IntFormat("int8", 8),
    IntFormat("int4", 4),
    CodeFormat("dt8", dynamic_tree_values(signed=True)),
    CodeFormat("udt8", dynamic_tree_values(signed=False), signed=False),
)

FORMATS: dict[str, Format] = {f.name: f for f in _TABLE}
"""Every named format, by canonical name."""

ALIASES: dict[str, str] = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "fp8_e4m3": "e4m3",
    "fp8_e5m2": "e5m2",
    "fp6_e3m2": "e3m2",
    "fp6_e2m3": "e2m3",
    "fp4_e2m1": "e2m1",
    "fp4": "e2m1",
    "mxfp4": "e2m1",
    "nvfp4": "e2m1",
}

_EXMY = re.compile(r"^e(\d)m(\d{1,2})$")


def _parse_exmy(name: str) -> FloatFormat | None:
    """A generic signed IEEE-like ``eXmY`` (2 <= X <= 8, 1 <= Y <= 23), see the module docstring."""
    match = _EXMY.match(name)
    if match is None:
        return None
    ebits, mbits = int(match.group(1)), int(match.group(2))
    if not (2 <= ebits <= 8 and 1 <= mbits <= 23):
        return None
    return FloatFormat(name, ebits, mbits, "ieee")


def get_format(name: str | Format) -> Format:
    """Look up a format by name (canonical, alias, or a parsed ``eXmY``).

    Args:
        name: e.g. ``"e4m3"``, ``"fp8_e4m3"``, ``"int8"``, ``"e3m4"``, ``"dt8"``; a format object is returned as is.

    Returns:
        The ``FloatFormat``, ``IntFormat`` or ``CodeFormat``.

    Raises:
        ValueError: unknown name (one line naming the value and the allowed names/pattern).
    """
    if isinstance(name, FloatFormat | IntFormat | CodeFormat):
        return name
    key = ALIASES.get(str(name).lower(), str(name).lower())
    fmt = FORMATS.get(key) or _parse_exmy(key)
    if fmt is None:
        allowed = ", ".join([*FORMATS, *ALIASES])
        raise ValueError(f"unknown format {name!r}: allowed {allowed}, or eXmY with 2<=X<=8, 1<=Y<=23")
    return fmt
