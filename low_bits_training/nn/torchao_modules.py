"""torchao's training modules: how to build and run the one that computes a layer's plan.

These are the real kernels users get (the torchao backend of ``plan.backends``): ``nn.torchao_recipes.torchao_recipe``
says which torchao module computes a plan (``Float8Linear`` for fp8 tensorwise / rowwise cast tables, ``MXFP8Linear``
for MXFP8); ``float8_config`` and ``mxfp8_mm`` build and run them; ``torchao_linear`` makes a plain module
(benchmarks, tests; training uses the torchtitan module classes of ``titan.targets.torchao_backend``). torchao is
imported only when a module is built, so this file imports on a machine without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .roles import ROLE_NAMES, ROLES, LinearPlan
from .torchao_recipes import TorchaoRecipe, torchao_recipe

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
    """torchao ``ScaleCalculationMode`` ("rceil" | "floor"; the recipe's ``mx_scale_mode``)."""
    wgrad_high: bool = False
    """The weight-gradient GEMM in high precision (torchao ``wgrad_with_hp``)."""
    dim0_cast_kernel: str = "triton"
    """torchao ``MXFP8Dim0CastKernelChoice`` (``[quantize.torchao] mxfp8_dim0_cast_kernel``)."""
    dim1_cast_kernel: str = "cuda"
    """torchao ``MXFP8Dim1CastKernelChoice`` (``[quantize.torchao] mxfp8_dim1_cast_kernel``)."""

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
    """The ``MXFP8Kernels`` of an MXFP8 ``recipe`` (``dim0`` / ``dim1``: the cast kernels asked for)."""
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
    if recipe.module == "NVFP4Linear":
        if emulated:
            raise ValueError("torchao's NVFP4Linear has no emulated mode (its kernels are Triton, CUDA only)")
        from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4Linear

        return NVFP4Linear.from_linear(lin, rht_sign_vector=recipe.rht_signs)  # the plan's signs, not a draw
    from torchao.float8.float8_linear import Float8Linear

    return Float8Linear.from_float(lin, config=float8_config(recipe, emulate=emulated))
