"""torchao's training modules: which one computes a layer's plan exactly, and how to build and run it.

These are the real kernels users get (the torchao backend of ``plan.backends``): ``torchao_recipe`` says
which torchao module computes a plan (``Float8Linear`` for fp8 tensorwise / rowwise cast tables, ``MXFP8Linear``
for MXFP8); ``float8_config`` and ``mxfp8_mm`` build and run them; ``torchao_linear`` makes a plain module
(benchmarks, tests; training uses the torchtitan module classes of ``titan.targets.torchao_backend``). torchao is
imported only when a module is built, so this file imports on a machine without it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

from low_bits_training.formats import QuantSpec

from .roles import GEMMS, ROLE_NAMES, ROLES, LinearPlan

_FP8 = ("e4m3", "e5m2")


@dataclass(frozen=True)
class TorchaoRecipe:
    """A torchao training module that computes exactly a layer's plan (pure data: which module, which casts)."""

    module: Literal["Float8Linear", "MXFP8Linear"]
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

    @property
    def min_capability(self) -> tuple[int, int]:
        """Smallest CUDA compute capability with torchao's kernel for this module."""
        return (8, 9) if self.module == "Float8Linear" else (10, 0)

    @property
    def dim_multiple(self) -> int:
        """Every feature dim must be a multiple of this (fp8 tensor cores: 16; MX blocks: 32)."""
        return 16 if self.module == "Float8Linear" else 32


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


def torchao_recipe(plan: LinearPlan) -> TorchaoRecipe | None:
    """The torchao training module that computes ``plan``'s numerics, or None.

    Float8Linear takes any plan of fp8 (e4m3/e5m2) tensorwise/rowwise casts with fp32 scales, round to nearest,
    saturating, one scale rounding (exact or power-of-two) for the whole layer, each tensor in one dtype, and
    both operands of a GEMM quantized or both high (torchao's own constraints); MXFP8Linear takes e4m3 1x32
    blocks with e8m0 rceil or floor scales, optionally with the weight-gradient GEMM high. Delayed scaling,
    an RHT or a forward-cast source never match. NVFP4 is never matched: torchao's NVFP4Linear runs our
    ``nvfp4`` recipe in outline (RHT 16 on the weight-gradient operands, 16x16 weight tiles, SR gradients)
    but not its numerics (a fixed sign vector, bf16 rotated values, a 2**-6 block-scale floor) and has no
    CPU or emulated mode (docs/precision_plan.md).

    Args:
        plan: a layer's plan (its backends are ignored).

    Returns:
        The recipe, or None when torchao has no module for this plan.
    """
    specs = tuple(_compat_free(s) for s in plan.specs)
    if all(s is None for s in specs):
        return None
    return _float8_recipe(specs) or _mxfp8_recipe(specs)


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


_FLOAT8_FIELDS = {  # Float8LinearConfig cast field per role (the same six operands as ROLES)
    "forward.input": "cast_config_input",
    "forward.weight": "cast_config_weight",
    "dgrad.grad_output": "cast_config_grad_output",
    "dgrad.weight": "cast_config_weight_for_grad_input",
    "wgrad.grad_output": "cast_config_grad_output_for_grad_weight",
    "wgrad.input": "cast_config_input_for_grad_weight",
}


def float8_config(
    recipe: TorchaoRecipe,
    emulate: bool,
    fast_accum_forward: bool = True,
    fsdp_float8_all_gather: bool = False,
    pad_inner_dim: bool = False,
):
    """torchao's ``Float8LinearConfig`` for a Float8 ``recipe`` (one ``CastConfig`` per role).

    Args:
        recipe: from ``torchao_recipe`` (module "Float8Linear").
        emulate: torchao's emulated GEMM (no fp8 hardware).
        fast_accum_forward, fsdp_float8_all_gather, pad_inner_dim: torchao's switches of those names
            (``gemm_config_output.use_fast_accum``, ``enable_fsdp_float8_all_gather``, ``pad_inner_dim``).

    Returns:
        The config; for torchao's named recipes it equals ``Float8LinearConfig.from_recipe_name`` (tested).
    """
    from torchao.float8.config import (
        CastConfig,
        Float8GemmConfig,
        Float8LinearConfig,
        ScalingGranularity,
        ScalingType,
    )

    dtypes = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
    casts = dict(zip(ROLE_NAMES, recipe.float8_casts, strict=True))
    by_operand = {r.operand: casts[r.name][0] for r in ROLES if casts[r.name]}  # torchao: one dtype each

    def cast_config(role) -> CastConfig:
        c = casts[role.name]
        if c is None:  # high precision; torchao still wants the tensor's dtype to agree across its GEMMs
            dtype = by_operand.get(role.operand, "e5m2" if role.operand == "grad_output" else "e4m3")
            return CastConfig(scaling_type=ScalingType.DISABLED, target_dtype=dtypes[dtype])
        return CastConfig(scaling_granularity=ScalingGranularity(c[1]), target_dtype=dtypes[c[0]])

    return Float8LinearConfig(
        **{_FLOAT8_FIELDS[r.name]: cast_config(r) for r in ROLES},
        gemm_config_output=Float8GemmConfig(use_fast_accum=fast_accum_forward),
        enable_fsdp_float8_all_gather=fsdp_float8_all_gather,
        pad_inner_dim=pad_inner_dim,
        emulate=emulate,
        round_scales_to_power_of_2=recipe.pow2_scales,
    )


@dataclass(frozen=True)
class MXFP8Kernels:
    """How torchao runs an MXFP8 layer: its ``mx_mm`` arguments beyond the operands."""

    emulated: bool = False
    """``KernelPreference.EMULATED`` (pure torch casts and GEMM, any device) instead of ``AUTO`` (SM100)."""
    scale_mode: str = "rceil"
    wgrad_high: bool = False
    dim0_cast_kernel: str = "triton"
    dim1_cast_kernel: str = "cuda"

    def torchao_enums(self) -> tuple:
        """(KernelPreference, ScaleCalculationMode, MXFP8Dim0CastKernelChoice, MXFP8Dim1CastKernelChoice)."""
        from torchao.prototype.mx_formats.config import (
            MXFP8Dim0CastKernelChoice,
            MXFP8Dim1CastKernelChoice,
            ScaleCalculationMode,
        )
        from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

        return (
            KernelPreference.EMULATED if self.emulated else KernelPreference.AUTO,
            ScaleCalculationMode(self.scale_mode),
            MXFP8Dim0CastKernelChoice(self.dim0_cast_kernel),
            MXFP8Dim1CastKernelChoice(self.dim1_cast_kernel),
        )


def mxfp8_mm(x: torch.Tensor, weight: torch.Tensor, kernels: MXFP8Kernels) -> torch.Tensor:
    """``x @ weight.T`` through torchao's MXFP8 training matmul (``mx_mm``: e4m3, 1x32 blocks), with the cast
    kernel choices torchao's own ``MXFP8Linear.forward`` hard-codes (triton dim0, cuda dim1)."""
    from torchao.prototype.moe_training.mxfp8_linear import mx_mm

    pref, mode, dim0, dim1 = kernels.torchao_enums()
    e4m3 = torch.float8_e4m3fn
    return mx_mm.apply(x, weight, e4m3, e4m3, e4m3, 32, pref, dim0, dim1, mode, kernels.wgrad_high)


def mxfp8_kernels(
    recipe: TorchaoRecipe, emulated: bool, dim0: str = "triton", dim1: str = "cuda"
) -> MXFP8Kernels:
    """The ``MXFP8Kernels`` of an MXFP8 ``recipe``."""
    return MXFP8Kernels(emulated, recipe.mx_scale_mode, recipe.wgrad_high, dim0, dim1)


class TorchaoMXFP8(torch.nn.Linear):
    """A plain ``nn.Linear`` running ``mxfp8_mm`` (benchmarks and tests; training uses the torchtitan module)."""

    def __init__(self, lin: torch.nn.Linear, kernels: MXFP8Kernels):
        super().__init__(lin.in_features, lin.out_features, bias=lin.bias is not None, device="meta")
        self.weight, self.bias, self.kernels = lin.weight, lin.bias, kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = mxfp8_mm(x, self.weight, self.kernels)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def torchao_linear(lin: torch.nn.Linear, plan: LinearPlan, emulated: bool) -> torch.nn.Module:
    """torchao's module for ``plan`` sharing ``lin``'s parameters (no torchtitan needed).

    Raises:
        ValueError: no torchao module computes the plan.
        ImportError: torchao is not installed.
    """
    recipe = torchao_recipe(plan)
    if recipe is None:
        raise ValueError(f"no torchao module computes this plan: {plan}")
    if recipe.module == "MXFP8Linear":
        return TorchaoMXFP8(lin, mxfp8_kernels(recipe, emulated))
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear.from_float(lin, config=float8_config(recipe, emulate=emulated))
