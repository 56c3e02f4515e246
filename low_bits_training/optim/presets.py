"""State and master-weight formats by short name ("int8_block128") or inline ``QuantSpec`` fields.

A state is always grouped along the parameter's last dim (``QuantSpec.axis = -1``): every block lies inside
one row, so a row-sharded (FSDP2 ``Shard(0)``) parameter quantizes its local rows exactly as the whole
tensor would, and the stored codes and scales reshard through DCP like the parameter itself.
"""

from __future__ import annotations

import re
from dataclasses import fields, replace
from typing import Any

from low_bits_training.formats import QuantSpec, get_format

NATIVE = ("fp32", "bf16", "fp16")
"""Formats stored as a plain torch dtype (no scales)."""

PRESETS: dict[str, QuantSpec] = {
    "fp32": QuantSpec("fp32", "none"),
    "bf16": QuantSpec("bf16", "none"),
    "fp16": QuantSpec("fp16", "none"),
    "int8_block128": QuantSpec("int8", "block", block_size=128),
    "int8_block64": QuantSpec("int8", "block", block_size=64),
    "e4m3_block128": QuantSpec("e4m3", "block", block_size=128),
    "e5m2_block128": QuantSpec("e5m2", "block", block_size=128),
    "e4m3_block32_e8m0": QuantSpec(
        "e4m3", "block", block_size=32, scale_format="e8m0", scale_rounding="ceil"
    ),
    "int4_block32_e8m0": QuantSpec(
        "int4", "block", block_size=32, scale_format="e8m0", scale_rounding="ceil"
    ),
    "e2m1_block32_e8m0": QuantSpec(
        "e2m1", "block", block_size=32, scale_format="e8m0", scale_rounding="ceil"
    ),
    "int4_block128": QuantSpec("int4", "block", block_size=128),
    "e2m1_block128": QuantSpec("e2m1", "block", block_size=128),
    "dt8_block256": QuantSpec("dt8", "block", block_size=256),
    "udt8_block256": QuantSpec("udt8", "block", block_size=256),
}
"""Named state formats. ``<fmt>_block<N>[_<scale fmt>]`` is also parsed for any element/scale format, and a
``_sr`` suffix on any name selects stochastic rounding of the state (unbiased EMA updates).
e8m0 scales use "ceil" rounding so the block max never saturates (a power-of-two scale >= amax/max).
``dt8`` / ``udt8``: the dynamic-tree codebooks (signed / unsigned) of bitsandbytes' and torchao's 8-bit
optimizers, in their 256-blocks with fp32 absmax scales (``formats.codebook``); ``udt8`` clamps negatives to 0,
so it is for the second moment only (``optim.options``)."""

_PATTERN = re.compile(r"^(?P<fmt>[a-z0-9]+)_block(?P<bs>\d+)(?:_(?P<sf>fp32|bf16|e8m0|ue4m3))?(?P<sr>_sr)?$")
_SPEC_KEYS = tuple(f.name for f in fields(QuantSpec))


def allowed_names() -> str:
    """The preset names, for error messages."""
    return ", ".join(PRESETS) + ", <fmt>_block<N>[_<scale fmt>][_sr], or a table of QuantSpec fields"


def _from_name(name: str) -> QuantSpec:
    base, sr = (name[:-3], True) if name.endswith("_sr") else (name, False)
    if base in PRESETS:
        spec = PRESETS[base]
    else:
        m = _PATTERN.match(base)
        if m is None:
            raise ValueError(f"unknown state format {name!r}")
        sf = m.group("sf") or "fp32"
        rounding = "exact" if sf in ("fp32", "bf16") else "ceil"
        spec = QuantSpec(
            m.group("fmt"), "block", block_size=int(m.group("bs")), scale_format=sf, scale_rounding=rounding
        )
    return with_rounding(spec, "stochastic") if sr else spec


def _from_table(d: dict[str, Any]) -> QuantSpec:
    unknown = sorted(set(d) - set(_SPEC_KEYS))
    if unknown:
        raise ValueError(f"unknown QuantSpec field(s) {unknown}; allowed {list(_SPEC_KEYS)}")
    return QuantSpec(**d)


def parse_state_format(value: str | dict[str, Any] | QuantSpec) -> QuantSpec:
    """A state format from a preset name, a ``<fmt>_block<N>`` name, a dict of QuantSpec fields, or a spec.

    Args:
        value: e.g. ``"int8_block128"``, ``"bf16"``, ``{format = "e4m3", scaling = "block", block_size = 64}``.

    Returns:
        A validated ``QuantSpec`` usable as optimizer state.

    Raises:
        ValueError: unknown name or field, or a spec a state cannot use: scaling other than "none"/"block",
            blocks not along the last dim, two-level scaling, or an unscaled format that is not native
            (fp32 / bf16 / fp16) nor at most 8 bits.
    """
    spec = (
        value
        if isinstance(value, QuantSpec)
        else (_from_table(value) if isinstance(value, dict) else _from_name(str(value).lower()))
    )
    if spec.scaling not in ("none", "block"):
        raise ValueError(
            f"scaling {spec.scaling!r} not usable for a state; use 'block' (along the last dim) or 'none'"
        )
    if spec.scaling == "block" and spec.axis != -1:
        raise ValueError(f"axis={spec.axis}: state blocks run along the last dim (axis=-1) so they reshard")
    if spec.tensor_scale:
        raise ValueError("tensor_scale=True: a per-tensor scale depends on the shard; not usable for a state")
    bits = get_format(spec.format).bits
    if spec.format not in NATIVE and bits > 8:
        raise ValueError(
            f"format {spec.format!r} has {bits} bits; states hold <= 8-bit codes or fp32/bf16/fp16"
        )
    if spec.scaling == "block" and spec.format in NATIVE:
        raise ValueError(f"format {spec.format!r} is stored natively; use scaling='none'")
    return spec


def with_rounding(spec: QuantSpec, rounding: str) -> QuantSpec:
    """``spec`` with its element rounding replaced."""
    return spec if spec.rounding == rounding else replace(spec, rounding=rounding)
