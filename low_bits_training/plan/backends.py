"""Which backend runs each GEMM of each linear layer, on which hardware: the one answer every tool asks.

The resolved plan stores a backend per GEMM (``LinearPlan.backends``); ``gemm_backend`` reads it, and the plan
table, ``lbt-doctor``, the benchmarks and the docs all ask that function. Values:

- ``high``: neither operand is quantized: a plain matmul (``nn.Linear``, or a high-precision GEMM of a layer).
- ``emulate``: our fake-quantize + fp32 matmul (``QuantLinear``), any device, any format.
- ``real``: our cast + ``torch._scaled_mm`` (``QuantLinear``): a Python-only reference, not offered in TOML.
- ``torchao``: torchao's module with its hardware kernel (``Float8Linear`` SM89+, ``MXFP8Linear`` SM100+,
  ``NVFP4Linear`` SM100+ with Triton: recipe ``nvfp4_torchao`` only).
- ``torchao_emulated``: torchao's module in its own emulated mode (CPU, or a GPU without the kernel; Float8 and
  MXFP8 only: NVFP4Linear has none, a layer without its kernel is ours).
- ``torchtitan``: a layer the base's own torchtitan converter already swapped (its numerics are torchtitan's).

Which layers torchao can take follows from the plan alone (``nn.torchao_recipes.torchao_recipe``): a layer goes to
torchao only when torchao's module computes the same numerics as the layer's plan. Why a layer does not get
torchao's kernel (no module computes its plan, its shape, the hardware, a kernel missing from the installed
torchao) is ``fallback_reason``: one answer for the plan table, lbt-doctor and the logs.
"""

from __future__ import annotations

from typing import Literal

from low_bits_training.config.quantize import BackendSetting, TorchaoOptions
from low_bits_training.errors import ConfigError
from low_bits_training.nn import GEMM_OPERANDS, GEMMS, LinearPlan
from low_bits_training.nn.hardware import Hardware
from low_bits_training.nn.recipes import RECIPES
from low_bits_training.nn.torchao_recipes import (
    TorchaoRecipe,
    nvfp4_mismatch,
    torchao_grouped_recipe,
    torchao_recipe,
)

GemmBackend = Literal["high", "emulate", "real", "torchao", "torchao_emulated", "torchtitan"]
TORCHAO_BACKENDS = ("torchao", "torchao_emulated")


def torchao_kernel_refusal(recipe: TorchaoRecipe, hw: Hardware) -> str | None:
    """Why torchao's hardware kernel for ``recipe`` cannot run on ``hw`` (None: it can)."""
    if not hw.torchao:
        return "torchao is not installed"
    need = recipe.min_capability
    if not hw.has(need):
        return f"{recipe.module} kernels need CUDA SM{need[0]}{need[1]}+, this is {hw}"
    if getattr(recipe, "needs_triton", False) and not hw.triton:  # grouped recipes: none is Triton-only
        return f"{recipe.module} kernels are Triton, and Triton is not available here"
    return None


def mxfp8_dim1_kernel(requested: str, hw: Hardware) -> tuple[str, str | None]:
    """The MXFP8 dim-1 cast kernel a torchao MXFP8 layer runs (``[quantize.torchao] mxfp8_dim1_cast_kernel``
    as far as ``hw`` has it), and why it differs from ``requested`` (None: it does not).

    The CUDA kernel falls back to torchao's Triton cast (the same e8m0 scales and e4m3 values), Triton to
    torchao's plain torch cast. Only where torchao's kernels run (SM100): its emulated mode casts in torch.
    """
    if not hw.has((10, 0)):
        return requested, None
    if requested == "cuda" and not hw.mxfp8_cuda_cast:
        instead = "triton" if hw.triton else "torch"
        return instead, (
            "torchao's MXFP8 CUDA cast (torch.ops.torchao.mxfp8_quantize) is not built into this torchao for "
            f"this torch / CUDA; dim-1 casts use its {instead} kernel"
        )
    if requested == "triton" and not hw.triton:
        return (
            "torch",
            f"Triton is not available here; dim-1 casts use torchao's torch kernel, not {requested}",
        )
    return requested, None


def torchao_shape_refusal(recipe: TorchaoRecipe, in_features: int, out_features: int, tp: int) -> str | None:
    """Why torchao's module cannot take a layer of this shape at all, kernel or emulated (None: it can)."""
    m = recipe.dim_multiple
    if in_features % (m * tp) or out_features % (m * tp):
        return (
            f"{recipe.module} needs features divisible by {m} per TP shard, got {in_features}x{out_features}"
        )
    if tp > 1:
        return "torchao modules are not wired for tensor parallelism here (emulation is)"
    return None


def grouped_backends(
    plan: LinearPlan, setting: str, hw: Hardware, in_features: int, out_features: int, tp: int = 1
) -> tuple[str, ...]:
    """``layer_backends`` of MoE expert weights: torchao's grouped-GEMM recipe
    (``nn.torchao_recipes.torchao_grouped_recipe``, run by torchtitan's experts classes) where it computes the
    plan and the device has its kernel; under ``torchao`` its emulated mode where torchao has one (MXFP8)."""
    recipe = torchao_grouped_recipe(plan) if setting != "emulate" else None
    m = recipe.dim_multiple if recipe is not None else 1
    fits = recipe is not None and tp == 1 and not (in_features % m or out_features % m)
    if not fits or not hw.torchao:
        return ("emulate",) * len(GEMMS)
    if hw.has(recipe.min_capability):
        return ("torchao",) * len(GEMMS)
    if setting == "torchao" and recipe.emulated_name is not None:
        return ("torchao_emulated",) * len(GEMMS)
    return ("emulate",) * len(GEMMS)


def layer_backends(
    plan: LinearPlan,
    setting: str,
    hw: Hardware,
    in_features: int,
    out_features: int,
    tp: int = 1,
    grouped: bool = False,
) -> tuple[str, ...]:
    """The backend of each GEMM (``GEMMS`` order) of a layer under ``[quantize] backend = setting``.

    Args:
        grouped: an MoE expert weight (``grouped_backends``).

    Returns:
        ("emulate",)*3 for ours, ("torchao",)*3 or ("torchao_emulated",)*3 for torchao's module.
    """
    if grouped:
        return grouped_backends(plan, setting, hw, in_features, out_features, tp)
    recipe = torchao_recipe(plan) if setting != "emulate" else None
    if recipe is None or torchao_shape_refusal(recipe, in_features, out_features, tp):
        return ("emulate",) * len(GEMMS)
    kernel_missing = torchao_kernel_refusal(recipe, hw)
    if kernel_missing is None:
        return ("torchao",) * len(GEMMS)
    if setting == "torchao" and hw.torchao and recipe.has_emulated_mode:
        return ("torchao_emulated",) * len(GEMMS)
    return ("emulate",) * len(GEMMS)


def _why_no_torchao(plan: LinearPlan) -> str:
    """The first feature of a plan no torchao training module computes (for ``fallback_reason``)."""
    specs = [s for s in plan.specs if s is not None]
    checks = (
        (lambda s: s.scaling in ("block", "tile") and (s.block_size, s.scale_format) == (16, "ue4m3"),
         lambda s: f"this NVFP4 (NVFP4Linear computes recipe nvfp4_torchao; here {m})"
         if (m := nvfp4_mismatch(plan)) else "NVFP4 (torchao 0.18's NVFP4 module is a dense linear only)"),
        (lambda s: s.amax_history > 0, "delayed scaling (torchao scales from the current amax)"),
        (lambda s: s.rht > 0, "a random Hadamard transform"),
        (lambda s: s.rounding != "nearest", lambda s: f"{s.rounding} rounding"),
        (lambda s: s.format not in ("e4m3", "e5m2"), lambda s: f"format {s.format}"),
        (lambda s: s.source != "high", "a cast of the forward's cast (source = 'forward')"),
        (lambda s: s.scaling == "tile" or s.scaling == "block" and (s.block_size, s.scale_format) != (32, "e8m0"),
         lambda s: f"{s.scaling} scaling (size {s.block_size}, {s.scale_format} scales)"),
    )  # fmt: skip
    for test, why in checks:
        hit = next((s for s in specs if test(s)), None)
        if hit is not None:
            return why(hit) if callable(why) else why
    return "its casts match no torchao recipe (a GEMM with one operand high, or mixed scale roundings)"


def fallback_reason(plan: LinearPlan, shape, hw: Hardware, setting: str, opts: TorchaoOptions | None = None):
    """Why a layer does not run torchao's hardware kernel under ``[quantize] backend = setting`` on ``hw``
    (None: it does, or nothing asked for it: ``emulate``, or a high-precision plan). The one answer the
    plan table, lbt-doctor and the logs give for a fallback.

    Args:
        plan: the layer's plan (numerics; its backends are not read).
        shape: its ``plan.resolve.LayerShape`` (in_features, out_features, tp, grouped).
        hw: the hardware (``detect_hardware``, or named: ``Hardware("cuda", (10, 0))``).
        setting: ``[quantize] backend``.
        opts: ``[quantize.torchao]`` (the MXFP8 dim-1 cast kernel asked for; default: torchao's).

    Returns:
        One line: what falls back to what, and why; None.
    """
    if setting == "emulate" or all(s is None for s in plan.specs):
        return None
    if getattr(shape, "product", ""):
        return "emulated: torchao has no module for attention products (Q K^T, P V)"
    grouped = getattr(shape, "grouped", False)
    recipe = torchao_grouped_recipe(plan) if grouped else torchao_recipe(plan)
    if recipe is None:
        return f"emulated: torchao has no {'grouped ' if grouped else ''}training module for {_why_no_torchao(plan)}"
    tp = getattr(shape, "tp", 1)
    m = recipe.dim_multiple
    if grouped and (tp > 1 or shape.in_features % m or shape.out_features % m):
        return f"emulated: {recipe.module} needs expert dims divisible by {m} and no TP"
    if not grouped and (why := torchao_shape_refusal(recipe, shape.in_features, shape.out_features, tp)):
        return f"emulated: {why}"
    if (why := torchao_kernel_refusal(recipe, hw)) is not None:
        has_mode = recipe.emulated_name is not None if grouped else recipe.has_emulated_mode
        emulated = setting == "torchao" and hw.torchao and has_mode
        return f"{'torchao emulated' if emulated else 'emulated'}: {why}"
    if recipe.module.startswith("MXFP8"):
        return mxfp8_dim1_kernel((opts or TorchaoOptions()).mxfp8_dim1_cast_kernel, hw)[1]
    return None


def gemm_backend(plan: LinearPlan, gemm: str) -> GemmBackend:
    """Which backend runs ``gemm`` ("forward" | "dgrad" | "wgrad") of a layer with this resolved plan.

    The one answer the plan table, lbt-doctor and the benchmarks give (see the module doc for the values).
    """
    backend = plan.backend(gemm)
    if backend in (*TORCHAO_BACKENDS, "torchtitan"):
        return backend
    op = GEMM_OPERANDS[gemm]
    if plan.specs[op.a] is None and plan.specs[op.b] is None:
        return "high"
    return backend


def check_backend_setting(backend: BackendSetting, hw: Hardware) -> None:
    """``[quantize] backend`` can run here (``QuantizeConfig`` already holds one of ``BACKEND_SETTINGS``).

    Raises:
        ConfigError: ``torchao`` without torchao installed.
    """
    if backend == "torchao" and not hw.torchao:
        raise ConfigError("quantize.backend = 'torchao': torchao is not installed; use 'emulate' or 'auto'")


def check_torchao_runs(
    setting: str, plans: dict[str, LinearPlan], shapes: dict, hw: Hardware, where: str = "quantize"
) -> None:
    """``backend = "torchao"`` asks torchao to run the plan: refuse a plan of which torchao runs no quantized
    layer (kernel or emulated mode); on a CPU not a plan whose layers only lack the GPU (NVFP4Linear has no
    emulated mode: the CPU emulates it, and lbt-doctor ``--hardware sm100`` judges it). Layers torchao cannot
    take in a plan it partly runs stay ours, each with its ``fallback_reason`` in the plan table and lbt-doctor.

    Args:
        setting: ``[quantize] backend``.
        plans: FQN -> resolved plan (its backends set).
        shapes: FQN -> ``plan.resolve.LayerShape``.
        hw: the hardware.
        where: the plan's TOML section (a phase: ``quantize.phases[0]``).

    Raises:
        ConfigError: one line naming the key, the value, the first layer's reason and what is allowed.
    """
    quantized = [f for f, p in plans.items() if not p.is_high_precision]
    if setting != "torchao" or not quantized:
        return
    if any(plans[f].backends[0] in TORCHAO_BACKENDS for f in quantized):
        return
    if hw.kind == "cpu" and any(_kernel_only(plans[f], shapes[f]) for f in quantized):
        return  # a module without an emulated mode (NVFP4Linear): a CPU runs emulation, equal to its numbers
    first = quantized[0]
    why = fallback_reason(plans[first], shapes[first], hw, setting)
    ours = ", ".join(r for r in RECIPES if torchao_recipe(LinearPlan.from_recipe(r)) is not None)
    phase = "" if where == "quantize" else f" ({where})"
    raise ConfigError(
        f"quantize.backend = 'torchao'{phase}: torchao runs none of this plan's quantized layers ({first}: "
        f"{why}); use backend 'auto' or 'emulate', or a plan torchao computes (recipes {ours})"
    )


def _kernel_only(plan: LinearPlan, shape) -> bool:
    """torchao's module computes ``plan`` at this shape and has no emulated mode: only its GPU kernel runs it
    (``fallback_reason`` on hardware that has the kernel: none)."""
    recipe = torchao_recipe(plan)
    if recipe is None or recipe.has_emulated_mode:
        return False
    return fallback_reason(plan, shape, Hardware("cuda", recipe.min_capability), "torchao") is None


def check_torchao_options(opts: TorchaoOptions, plans: dict[str, LinearPlan]) -> None:
    """``[quantize.torchao]`` against the resolved plans.

    Raises:
        ConfigError: precompute without fp8 all-gather, or fp8 all-gather with a torchao Float8 layer whose
            weight is not tensorwise.
    """
    if opts.precompute_float8_dynamic_scale_for_fsdp and not opts.enable_fsdp_float8_all_gather:
        raise ConfigError(
            "quantize.torchao.precompute_float8_dynamic_scale_for_fsdp = true needs "
            "quantize.torchao.enable_fsdp_float8_all_gather = true"
        )
    if not opts.enable_fsdp_float8_all_gather:
        return
    for fqn, plan in plans.items():
        recipe = torchao_recipe(plan) if plan.backends[0].startswith("torchao") else None
        if (
            recipe is not None
            and recipe.module == "Float8Linear"
            and recipe.float8_casts[1][1] != "tensorwise"
        ):
            raise ConfigError(
                f"quantize.torchao.enable_fsdp_float8_all_gather = true: {fqn} scales its weight "
                f"{recipe.float8_casts[1][1]} ({recipe.label}); torchao all-gathers fp8 weights only with "
                "tensorwise scaling (recipe fp8_tensorwise)"
            )
