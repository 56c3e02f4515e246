"""Which torchao training module computes a layer's plan exactly: pure data, decided from the plan alone.

``torchao_recipe`` matches a ``LinearPlan`` to ``Float8Linear`` (fp8 tensorwise / rowwise cast tables),
``MXFP8Linear`` (MXFP8) or ``NVFP4Linear`` (recipe ``nvfp4_torchao`` exactly) and says which casts and switches it takes (``TorchaoRecipe``);
``torchao_grouped_recipe`` does the same for MoE experts (torchtitan's ``Float8GroupedExperts`` /
``MXFP8GroupedExperts``). Nothing here imports torchao, so the backend choice (``plan.backends``) runs on a
machine without it; ``nn.torchao_modules`` builds and runs the modules.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from low_bits_training.formats import QuantSpec
from low_bits_training.formats.hadamard import operand_signs

from .roles import GEMMS, ROLES, LinearPlan

_FP8 = ("e4m3", "e5m2")


@dataclass(frozen=True)
class TorchaoRecipe:
    """A torchao training module that computes exactly a layer's plan (pure data: which module, which casts)."""

    module: Literal["Float8Linear", "MXFP8Linear", "NVFP4Linear"]
    label: str
    """Short name for logs and tables: torchao's recipe name when the plan is one ("rowwise"), else a
    description of the casts."""
    float8_casts: tuple[tuple[str, str] | None, ...] = ()
    """Float8Linear: per role (``ROLES`` order) (format, "tensorwise" | "axiswise"), None where disabled."""
    pow2_scales: bool = False
    """Float8Linear ``round_scales_to_power_of_2`` (our scale_rounding "rceil")."""
    mx_scale_mode: Literal["rceil", "floor"] = "rceil"
    """MXFP8Linear ``scale_calculation_mode``."""
    wgrad_high: bool = False
    """MXFP8Linear ``wgrad_with_hp``: the weight-gradient GEMM in high precision."""
    rht_signs: tuple[int, ...] = ()
    """NVFP4Linear ``rht_sign_vector``: the wgrad RHT's 16 signs, passed to torchao explicitly (the plan's)."""

    @property
    def min_capability(self) -> tuple[int, int]:
        """Smallest CUDA compute capability with torchao's kernel for this module."""
        return (8, 9) if self.module == "Float8Linear" else (10, 0)

    @property
    def dim_multiple(self) -> int:
        """Every feature dim must be a multiple of this (fp8 tensor cores: 16; MX blocks: 32; torchao's NVFP4
        Triton kernels: 128, ``nvfp4_mm_triton``)."""
        return {"Float8Linear": 16, "MXFP8Linear": 32}.get(self.module, 128)

    @property
    def has_emulated_mode(self) -> bool:
        """torchao runs the module without its hardware kernel (Float8 / MXFP8 ``emulate``); NVFP4Linear is
        Triton only, so a layer without its kernel stays ours."""
        return self.module != "NVFP4Linear"

    @property
    def needs_triton(self) -> bool:
        """Its kernels are Triton (NVFP4Linear's casts, RHT and stochastic rounding are all Triton)."""
        return self.module == "NVFP4Linear"


_FLOAT8_NAMES = {
    "tensorwise": (
        tuple(("e5m2" if r.operand == "grad_output" else "e4m3", "tensorwise") for r in ROLES),
        False,
    ),
    "rowwise": ((("e4m3", "axiswise"),) * 6, True),
    "rowwise_with_gw_hp": ((("e4m3", "axiswise"),) * 3 + (("e4m3", "tensorwise"), None, None), True),
}
"""torchao's named Float8 recipes (``Float8LinearConfig.from_recipe_name``): per-role casts (``ROLES`` order)
and power-of-two scales; used for labels only (any valid cast table is built the same way)."""


def _compat_free(spec: QuantSpec | None) -> QuantSpec | None:
    # scale_min / inf_amax only say how the emulation treats corner cases torchao treats its own way
    # (docs/formats.md): they do not change which torchao module computes the plan.
    return None if spec is None else replace(spec, scale_min="subnormal", inf_amax="keep")


def _float8_cast(spec: QuantSpec) -> tuple[str, str] | None:
    plain = (
        spec.format in _FP8
        and spec.scaling in ("tensor", "axis")
        and spec.scale_format == "fp32"
        and spec.scale_rounding in ("exact", "rceil")
        and spec.rounding == "nearest"
        and spec.saturate
        and spec.margin == 0
        and not spec.tensor_scale
        and (spec.amax_history, spec.rht, spec.source) == (0, 0, "high")  # torchao: current scaling, no RHT
    )
    return (spec.format, "tensorwise" if spec.scaling == "tensor" else "axiswise") if plain else None


def _float8_recipe(specs: tuple[QuantSpec | None, ...]) -> TorchaoRecipe | None:
    casts = []
    for spec in specs:
        cast = None if spec is None else _float8_cast(spec)
        if spec is not None and cast is None:
            return None
        casts.append(cast)
    quantized = [s for s in specs if s is not None]
    if not quantized or len({s.scale_rounding for s in quantized}) > 1:
        return None  # torchao's power-of-two scale switch is one per module
    for gemm in GEMMS:  # both operands of a GEMM fp8, or both high
        pair = [c for c, r in zip(casts, ROLES, strict=True) if r.gemm == gemm]
        if (pair[0] is None) != (pair[1] is None):
            return None
    for operand in ("input", "weight", "grad_output"):  # torchao: one dtype per tensor across its GEMMs
        if len({c[0] for c, r in zip(casts, ROLES, strict=True) if c and r.operand == operand}) > 1:
            return None
    pow2 = quantized[0].scale_rounding == "rceil"
    label = next((n for n, named in _FLOAT8_NAMES.items() if named == (tuple(casts), pow2)), "custom")
    return TorchaoRecipe("Float8Linear", label, tuple(casts), pow2_scales=pow2)


def _mxfp8_recipe(specs: tuple[QuantSpec | None, ...]) -> TorchaoRecipe | None:
    for mode in ("rceil", "floor"):
        mx = QuantSpec.mxfp8("e4m3", mode)
        for wgrad_high in (False, True):
            want = tuple(None if wgrad_high and r.gemm == "wgrad" else mx for r in ROLES)
            if LinearPlan(specs).specs == LinearPlan(want).specs:
                return TorchaoRecipe(
                    "MXFP8Linear", f"mxfp8 {mode}", mx_scale_mode=mode, wgrad_high=wgrad_high
                )
    return None


NVFP4_TORCHAO = "nvfp4_torchao"
"""The recipe that computes what torchao's ``NVFP4Linear`` (``NVFP4TrainingConfig``) computes."""


def _ao_free(spec: QuantSpec | None) -> QuantSpec | None:
    # inf_amax only says how the emulation treats an inf amax (docs/formats.md); scale_min is kept: "normal" is
    # torchao's 2^-6 block-scale floor. The RHT's sign vector (named or seeded) is any fixed vector of 16 signs,
    # which torchao takes as rht_sign_vector: it is not compared.
    return None if spec is None else replace(spec, inf_amax="keep", rht_seed=0, rht_signs="seeded")


def nvfp4_mismatch(plan: LinearPlan) -> str | None:
    """How ``plan`` differs from what torchao's ``NVFP4Linear`` computes (recipe ``nvfp4_torchao``): the first
    role and its fields that differ, one line; None when it computes exactly that.

    Our options map to torchao's module one to one, and only one setting of each exists there: every role
    e2m1 with ue4m3 1x16 block scales (16x16 tiles on both weight roles: ``triton_weight_quantize_2d``) under
    an fp32 tensor scale (``per_tensor_amax_to_scale``); ``scale_order = "torchao"`` + ``scale_apply =
    "reciprocal"`` + ``scale_min = "normal"`` = its Triton casts' block-scale arithmetic; stochastic rounding
    on both gradient roles (``triton_rht_quantize_row_col(stochastic_rounding=True)``), nearest elsewhere; the
    wgrad operands rotated by a 16-point RHT (``rht = 16``) with ``rht_signs`` = ``rht_sign_vector``, the
    rotated values stored in bf16 (``rht_output = "bf16"``). No torchao switch changes any of these but the
    sign vector, which we pass: any fixed one (``rht_signs`` "te", or "seeded" from the plan's seed) fits.
    """
    want = LinearPlan.from_recipe(NVFP4_TORCHAO).specs
    for role, have, need in zip(ROLES, plan.specs, want, strict=True):
        have, need = _ao_free(have), _ao_free(need)
        if have == need:
            continue
        if have is None:
            return f"{role.name} high precision (torchao quantizes it)"
        if need is None:
            return f"{role.name} quantized (torchao keeps it high)"
        diff = [
            f"{f} {getattr(have, f)!r} (torchao: {getattr(need, f)!r})"
            for f in have.__dataclass_fields__
            if getattr(have, f) != getattr(need, f)
        ]
        return f"{role.name} {', '.join(diff)}"
    return None


def _nvfp4_recipe(plan: LinearPlan) -> TorchaoRecipe | None:
    if nvfp4_mismatch(plan) is not None:
        return None
    rotated = next(s for s in plan.specs if s is not None and s.rht)
    return TorchaoRecipe("NVFP4Linear", NVFP4_TORCHAO, rht_signs=operand_signs(rotated))


def torchao_recipe(plan: LinearPlan) -> TorchaoRecipe | None:
    """The torchao training module that computes ``plan``'s numerics, or None.

    Float8Linear takes any plan of fp8 (e4m3/e5m2) tensorwise/rowwise casts with fp32 scales, round to nearest,
    saturating, one scale rounding (exact or power-of-two) for the whole layer, each tensor in one dtype, and
    both operands of a GEMM quantized or both high (torchao's own constraints); MXFP8Linear takes e4m3 1x32
    blocks with e8m0 rceil or floor scales, optionally with the weight-gradient GEMM high. Delayed scaling,
    an RHT or a forward-cast source never match Float8 / MXFP8. torchao's NVFP4Linear takes recipe
    ``nvfp4_torchao``'s plan exactly (``nvfp4_mismatch``; its sign vector passed), not ``nvfp4``'s (our scale
    order, fp32 rotated values, e4m3 subnormal block scales, seeded signs: docs/formats.md, "Equal to whom").

    Args:
        plan: a layer's plan (its backends are ignored).

    Returns:
        The recipe, or None when torchao has no module for this plan.
    """
    specs = tuple(_compat_free(s) for s in plan.specs)
    if all(s is None for s in specs):
        return None
    return _float8_recipe(specs) or _mxfp8_recipe(specs) or _nvfp4_recipe(plan)


@dataclass(frozen=True)
class TorchaoGroupedRecipe:
    """A torchao grouped-GEMM recipe for MoE experts that computes a plan (through torchtitan's experts
    classes: ``Float8GroupedExperts``, ``MXFP8GroupedExperts``)."""

    module: Literal["Float8GroupedExperts", "MXFP8GroupedExperts"]
    recipe_name: str
    """The name torchtitan's class takes: ``rowwise``, ``mxfp8_rceil``, ``mxfp8_rceil_wgrad_with_hp``."""
    emulated_name: str | None
    """torchao's hardware-agnostic mode of the same recipe (``mxfp8_emulated_rceil``: to_mx casts, bf16
    grouped GEMMs in plain torch, runs on a CPU); None: it has none."""
    min_capability: tuple[int, int]
    """Smallest CUDA compute capability with the kernel (torchtitan's converters check the same)."""
    pad_multiple: int
    """Token-group row multiple torchtitan's padding dispatcher uses for it."""
    dim_multiple: int
    """Every expert feature dim must be a multiple of this."""


def torchao_grouped_recipe(plan: LinearPlan) -> TorchaoGroupedRecipe | None:
    """The torchao grouped-GEMM recipe that computes ``plan`` on expert weights, or None.

    MXFP8 with RCEIL e8m0 scales (optionally the weight-gradient GEMM high), and torchao's Float8 ``rowwise``
    cast table (the one the previous grouped fp8 converter of torchtitan takes); nothing else.
    """
    linear = torchao_recipe(plan)
    if linear is None:
        return None
    if linear.module == "MXFP8Linear" and linear.mx_scale_mode == "rceil":
        name = "mxfp8_rceil_wgrad_with_hp" if linear.wgrad_high else "mxfp8_rceil"
        emulated = None if linear.wgrad_high else "mxfp8_emulated_rceil"
        return TorchaoGroupedRecipe("MXFP8GroupedExperts", name, emulated, (10, 0), 32, 32)
    if linear.module == "Float8Linear" and linear.label == "rowwise":
        return TorchaoGroupedRecipe("Float8GroupedExperts", "rowwise", None, (8, 9), 16, 16)
    return None
