"""QuantSpec: how one tensor is put onto a low-bit grid (element format, scaling, rounding)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

from .hadamard import NAMED_SIGNS
from .table import get_format

Scaling = Literal["none", "tensor", "axis", "block", "tile"]
ScaleRounding = Literal["exact", "floor", "ceil", "rceil"]
RoundingMode = Literal["nearest", "stochastic", "toward_zero"]
ScaleMin = Literal["subnormal", "normal"]
InfAmax = Literal["keep", "nan"]
FourOverSix = Literal["off", "mse", "mae"]
AmaxCompute = Literal["max", "most_recent"]
Source = Literal["high", "forward"]
RhtSigns = Literal["seeded", "te"]
ScaleApply = Literal["divide", "reciprocal"]
ScaleUnderflow = Literal["clamp", "zero"]
ScaleOrder = Literal["decode", "te", "torchao"]
RhtOutput = Literal["fp32", "bf16"]
ScaleFormat = Literal["fp32", "bf16", "e8m0", "ue4m3"]
SCALE_FORMATS: tuple[str, ...] = get_args(ScaleFormat)
HIGH = "high"
"""High precision: no quantization. The value a rule's ``format``, an autopilot rung, a wire or a saved
format gives to keep a tensor in its own dtype (one name for every section)."""
_ROUNDING_LABEL = {"nearest": "rne", "stochastic": "sr", "toward_zero": "rtz"}


@functools.cache
def choice_fields(cls: type) -> tuple[tuple[str, tuple], ...]:
    """``(field name, allowed values)`` of each field of dataclass ``cls`` annotated with a ``Literal`` (read
    once per class: resolving annotations costs about a millisecond; plans make specs by the thousand)."""
    hints = get_type_hints(cls)
    return tuple(
        (f.name, get_args(hints[f.name])) for f in fields(cls) if get_origin(hints[f.name]) is Literal
    )


@dataclass(frozen=True)
class QuantSpec:
    """Quantization recipe for one tensor. Frozen; every field is validated at construction."""

    format: str
    """Element format name (see ``get_format``): "e4m3", "e2m1", "int8", "e3m4", ..."""
    scaling: Scaling = "tensor"
    """"none" (round the values as they are), "tensor" (one scale), "axis" (one scale per slice, shared
    along ``axis``), "block" (1 x block_size groups along ``axis``), "tile" (block_size x block_size tiles
    over the last two dims)."""
    axis: int = -1
    """For "axis": the dim reduced over (-1 on a 2-D tensor = one scale per row). For "block": the dim the
    blocks run along."""
    block_size: int = 32
    """Group length for "block", tile side for "tile"."""
    scale_format: ScaleFormat = "fp32"
    """Format the scales are stored in: "fp32" | "bf16" | "e8m0" | "ue4m3"."""
    scale_rounding: ScaleRounding = "exact"
    """How amax becomes a scale: "exact" amax/max_elem rounded (RNE) to scale_format; "floor" 2**(floor(log2
    amax) - emax_elem) (OCP MX v1.0 sec. 6.3); "ceil" 2**(ceil(log2 amax) - emax_elem); "rceil" amax/max_elem
    rounded up to a power of two (NVIDIA cuBLAS / torchao RCEIL; TE's power-of-two fp8 block scales)."""
    rounding: RoundingMode = "nearest"
    """Element rounding: "nearest" (ties to even), "stochastic", "toward_zero"."""
    saturate: bool = True
    """Overflow clamps to +-max; False: the format's own inf/NaN behaviour (see ``round_to``)."""
    margin: int = 0
    """Extra power-of-two headroom: the scale is multiplied by 2**margin before it is rounded."""
    tensor_scale: bool = False
    """Two-level scaling (NVFP4): block scales are computed relative to an fp32 per-tensor scale
    amax / (max_scale_format * max_elem) and stored in scale_format."""
    scale_min: ScaleMin = "subnormal"
    """Smallest scale kept: "subnormal" (the scale format's smallest subnormal: 2**-9 for ue4m3) or "normal"
    (its smallest normal: 2**-6 for ue4m3, as torchao clamps NVFP4 block scales). Formats without
    subnormals (e8m0, fp32 in practice) are unaffected."""
    inf_amax: InfAmax = "keep"
    """A group whose amax is infinite: "keep" (the infinite elements stay +-inf, the group's finite ones
    become 0) or "nan" (the whole group becomes NaN, as torchao's fp8 casts do)."""
    four_over_six: FourOverSix = "off"
    """Adaptive block scaling "4over6" (e2m1 blocks/tiles, "exact" scales): each group is scaled both so its
    amax maps to 6 and to 4, and keeps the one with the lower round-to-nearest error, "mse" (sum of squares)
    or "mae" (sum of magnitudes); the two-level tensor scale then uses 256 in place of the scale format's max
    (arXiv 2512.02010; Transformer Engine's 4over6 NVFP4 recipe). "off": always 6."""
    scale_apply: ScaleApply = "divide"
    """How a value meets its group's scale before it is rounded: "divide" (x / scale, correctly rounded) or
    "reciprocal" (x times the fp32 reciprocal of the scale, fl(1 / scale), as Transformer Engine's NVFP4
    and MXFP8 quantizers do: a value whose quotient is an exact grid midpoint may then round the other way,
    e.g. -300 under a scale of 120 in e2m1 is -240 divided and -360 by the reciprocal). The same for
    power-of-two scales (their reciprocal is exact)."""
    scale_underflow: ScaleUnderflow = "clamp"
    """A nonzero group whose exact scale rounds to 0 in ``scale_format`` (block amax below about 2**-18.8 of
    the tensor amax in NVFP4): "clamp" (the scale format's smallest scale, ``scale_min``: its values are kept
    as well as that scale allows) or "zero" (the group becomes 0, as Transformer Engine's NVFP4 quantizer
    leaves it). "zero" needs ``scale_rounding = "exact"``."""
    scale_order: ScaleOrder = "decode"
    """The fp32 arithmetic of two-level scales: "decode" (ours: tensor scale fl(amax / 2688), block scale
    round(fl(fl(amax_b / 6) / tensor scale)), 2688 = 448 x 6 for NVFP4) or "te" (Transformer Engine's NVFP4
    quantizer: the tensor encode scale e = fl(2688 / amax), block scale round(fl(amax_b x fl(e x fl(1 / 6)))),
    and the values multiplied by fl(1 / fl(block scale x fl(1 / e))), each capped at fp32's max; a value that
    is 0 in scale units gets the +0 code) or "torchao" (torchao 0.18's NVFP4 training kernels: as "te" but the
    block scale round(fl(fl(amax_b / 6) x e)), signs kept). Either way a value dequantizes as (element x block
    scale) x fl(amax / 2688). "te" / "torchao" need ``tensor_scale``, "exact" scales, ``scale_apply =
    "reciprocal"`` and no 4over6 (``formats.te_order``). One level: "te" on fp32 blocks / tiles is TE's
    Float8BlockQuantizer, values times fl(448 / amax_b), scale fl(1 / that), signs kept."""
    amax_history: int = 0
    """Delayed scaling ("tensor" scaling only): 0 is current scaling (the amax of the tensor itself); N > 0 takes
    the amax from the last N casts of this operand (a history the layer keeps, ``nn.delayed``), as TE's
    DelayedScaling. Without a history (``fake_quantize`` alone) it is current scaling."""
    amax_compute: AmaxCompute = "max"
    """Delayed scaling: the amax of the history, "max" (of all N) or "most_recent"."""
    rht: int = 0
    """GEMM operand transform: a random Hadamard transform of this size (a power of two, 0: none) applied along
    the GEMM's contraction dim before the cast, by the quantized matmul (``nn``), to both operands so that it
    cancels in the product. ``fake_quantize`` does not apply it (``formats.hadamard``)."""
    rht_seed: int = 0
    """Seed of the RHT's random sign vector (``hadamard.sign_vector``): the same on every rank."""
    rht_signs: RhtSigns = "seeded"
    """The RHT's sign vector: "seeded" (drawn from ``rht_seed``) or a fixed vector by name (``formats.hadamard.
    NAMED_SIGNS``): "te", Transformer Engine's 16-long NVFP4 wgrad vector (needs ``rht = 16``)."""
    rht_output: RhtOutput = "fp32"
    """The RHT's result before the cast: "fp32", or rounded to "bf16" (RNE), as torchao's NVFP4 training
    kernels store the rotated tile before its amax and cast (read only with ``rht``)."""
    source: Source = "high"
    """What a backward GEMM operand is cast from (``nn``): "high" (the high-precision tensor) or "forward"
    (the forward GEMM's cast of the same tensor, cast again: dgrad.weight and wgrad.input only)."""

    def __post_init__(self) -> None:
        get_format(self.format)  # raises the one-line unknown-format error
        for name, allowed in choice_fields(type(self)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"QuantSpec.{name}={getattr(self, name)!r} is not one of {allowed}")
        self._check_numbers()

    def _check_numbers(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"QuantSpec.block_size={self.block_size!r} must be a positive int")
        if not isinstance(self.axis, int):
            raise ValueError(f"QuantSpec.axis={self.axis!r} must be an int")
        if not isinstance(self.margin, int) or abs(self.margin) > 64:
            raise ValueError(f"QuantSpec.margin={self.margin!r} must be an int in [-64, 64]")
        if not isinstance(self.saturate, bool) or not isinstance(self.tensor_scale, bool):
            raise ValueError(
                f"QuantSpec.saturate/tensor_scale={self.saturate!r}/{self.tensor_scale!r} must be bool"
            )
        if self.tensor_scale and self.scaling not in ("block", "tile", "axis"):
            raise ValueError(
                f"QuantSpec.tensor_scale=True needs scaling block/tile/axis, got {self.scaling!r}"
            )
        self._check_operand_options()

    def _check_operand_options(self) -> None:
        # 4over6, delayed scaling and the RHT: what each needs (issue 13).
        for name, top in (("amax_history", 2**16), ("rht", 2**16), ("rht_seed", 2**62)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= top:
                raise ValueError(f"QuantSpec.{name}={v!r} must be an int in [0, {top}]")
        if self.rht and (self.rht < 2 or self.rht & (self.rht - 1)):
            raise ValueError(f"QuantSpec.rht={self.rht} must be 0 (off) or a power of two >= 2")
        named = len(NAMED_SIGNS.get(self.rht_signs, ()))
        if self.rht and named and self.rht != named:
            raise ValueError(
                f"QuantSpec.rht_signs={self.rht_signs!r} is a {named}-long vector; it needs rht = {named}, "
                f"got {self.rht}"
            )
        if self.scale_underflow == "zero" and (self.scale_rounding != "exact" or self.scaling == "none"):
            raise ValueError(
                "QuantSpec.scale_underflow='zero' needs scaled groups with scale_rounding 'exact', got "
                f"{self.scaling!r}, {self.scale_rounding!r}"
            )
        one = self.scale_order == "te" and self.scaling in ("block", "tile") and self.scale_format == "fp32"
        if self.scale_order != "decode" and (
            not (self.tensor_scale or one and not self.margin)
            or self.scale_rounding != "exact"
            or self.scale_apply != "reciprocal"
            or self.four_over_six != "off"
        ):
            raise ValueError(
                f"QuantSpec.scale_order={self.scale_order!r} needs tensor_scale=True ('te': or fp32 blocks / tiles "
                "without a margin), scale_rounding 'exact', "
                f"scale_apply 'reciprocal' and four_over_six 'off', got {self.tensor_scale}, {self.scale_rounding!r}, "
                f"{self.scale_apply!r}, {self.four_over_six!r}"
            )
        if self.amax_history and self.scaling != "tensor":
            raise ValueError(
                f"QuantSpec.amax_history={self.amax_history} (delayed scaling) needs scaling 'tensor', "
                f"got {self.scaling!r}"
            )
        if self.four_over_six != "off" and (
            self.format != "e2m1" or self.scaling not in ("block", "tile") or self.scale_rounding != "exact"
        ):
            raise ValueError(
                f"QuantSpec.four_over_six={self.four_over_six!r} needs format 'e2m1', scaling block/tile and "
                f"scale_rounding 'exact', got {self.format!r}, {self.scaling!r}, {self.scale_rounding!r}"
            )

    @property
    def rht_key(self) -> tuple[int, int, str]:
        """What decides the RHT of this operand, ``(rht, rht_seed, rht_signs)``: the two operands of a GEMM
        must agree on it for the transform to cancel, and ``formats.hadamard.operand_signs`` reads it."""
        return self.rht, self.rht_seed, self.rht_signs

    @property
    def elem(self):
        """The element format object."""
        return get_format(self.format)

    def short(self) -> str:
        """Compact label, e.g. "e4m3/block32(e8m0,floor)/rne"."""
        where = {
            "none": "none",
            "tensor": "tensor",
            "axis": f"axis{self.axis}",
            "block": f"block{self.block_size}" + (f"@{self.axis}" if self.axis != -1 else ""),
            "tile": f"tile{self.block_size}x{self.block_size}",
        }[self.scaling]
        if self.scaling != "none":
            extra = "+t32" if self.tensor_scale else ""
            extra += f",m{self.margin}" if self.margin else ""
            extra += ",minN" if self.scale_min == "normal" else ""
            extra += ",infNaN" if self.inf_amax == "nan" else ""
            extra += f",4/6{self.four_over_six}" if self.four_over_six != "off" else ""
            extra += ",recip" if self.scale_apply == "reciprocal" else ""
            extra += ",uf0" if self.scale_underflow == "zero" else ""
            extra += {"decode": "", "te": ",teorder", "torchao": ",aoorder"}[self.scale_order]
            extra += f",delayed{self.amax_history}{self.amax_compute}" if self.amax_history else ""
            where += f"({self.scale_format},{self.scale_rounding}{extra})"
        sat = "" if self.saturate else "/nosat"
        signs = (
            self.rht_signs if self.rht_signs != "seeded" else (f"s{self.rht_seed}" if self.rht_seed else "")
        )
        pre = f"rht{self.rht}{signs}{'/bf16' if self.rht_output == 'bf16' else ''}:" if self.rht else ""
        pre = ("fwd:" if self.source == "forward" else "") + pre
        return f"{pre}{self.elem.name}/{where}/{_ROUNDING_LABEL[self.rounding]}{sat}"

    __str__ = short

    # Convenience constructors for the recipes people name.
    @classmethod
    def mxfp8(cls, fmt: str = "e4m3", scale_rounding: ScaleRounding = "rceil", **kw) -> QuantSpec:
        """MXFP8 as recipe ``mxfp8`` trains it: OCP MX 1x32 blocks, e8m0 scales, torchao's training default
        scale rounding "rceil" (pass ``scale_rounding="floor"`` for the OCP spec's own rule)."""
        return cls(fmt, "block", block_size=32, scale_format="e8m0", scale_rounding=scale_rounding, **kw)

    @classmethod
    def mxfp6(cls, fmt: str = "e2m3", scale_rounding: ScaleRounding = "floor", **kw) -> QuantSpec:
        """OCP MXFP6 (e2m3 or e3m2): 1x32 blocks, e8m0 scales, the spec's "floor" scale rounding (recipe
        ``mxfp6``)."""
        return cls.mxfp8(fmt, scale_rounding, **kw)

    @classmethod
    def mxfp4(cls, scale_rounding: ScaleRounding = "floor", **kw) -> QuantSpec:
        """OCP MXFP4: e2m1 elements, 1x32 blocks, e8m0 scales, the spec's "floor" scale rounding (recipe
        ``mxfp4``)."""
        return cls.mxfp8("e2m1", scale_rounding, **kw)

    @classmethod
    def nvfp4(cls, **kw) -> QuantSpec:
        """NVFP4: e2m1 elements, 1x16 blocks, ue4m3 scales under an fp32 per-tensor scale."""
        return cls("e2m1", "block", block_size=16, scale_format="ue4m3", tensor_scale=True, **kw)

    @classmethod
    def fp8_tensorwise(cls, fmt: str = "e4m3", **kw) -> QuantSpec:
        """One fp32 scale amax/max for the whole tensor (torchao Float8 "tensorwise")."""
        return cls(fmt, "tensor", **kw)

    @classmethod
    def fp8_rowwise(cls, fmt: str = "e4m3", axis: int = -1, **kw) -> QuantSpec:
        """One fp32 scale per row (reduced over ``axis``, the GEMM contraction dim)."""
        return cls(fmt, "axis", axis=axis, **kw)

    @classmethod
    def deepseek_weight(cls, fmt: str = "e4m3", **kw) -> QuantSpec:
        """DeepSeek-V3 weights: 128x128 tiles, fp32 scales."""
        return cls(fmt, "tile", block_size=128, **kw)

    @classmethod
    def deepseek_act(cls, fmt: str = "e4m3", axis: int = -1, **kw) -> QuantSpec:
        """DeepSeek-V3 activations: 1x128 blocks along ``axis``, fp32 scales."""
        return cls(fmt, "block", axis=axis, block_size=128, **kw)

    @classmethod
    def int8_rowwise(cls, axis: int = -1, **kw) -> QuantSpec:
        """Symmetric int8 (+-127), one fp32 scale per row."""
        return cls("int8", "axis", axis=axis, **kw)


@functools.cache
def shared_spec_fields(cls: type) -> tuple[str, ...]:
    """The ``QuantSpec`` fields, ``format`` aside, that dataclass ``cls`` declares too (a config section:
    ``[[quantize.rules]]``, a wire format, a saved format), in ``QuantSpec``'s order."""
    own = {f.name for f in fields(cls)}
    return tuple(f.name for f in fields(QuantSpec) if f.name != "format" and f.name in own)


def spec_kwargs(section: Any) -> dict[str, Any]:
    """The ``QuantSpec`` keyword arguments a config section gives: its ``shared_spec_fields`` by name, those
    that are set (not None). ``format`` is left to the caller (each section has its own "high" / casts)."""
    values = ((name, getattr(section, name)) for name in shared_spec_fields(type(section)))
    return {name: v for name, v in values if v is not None}
