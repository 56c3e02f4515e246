"""The torchao backend: torchao's training modules in torchtitan's config tree, for layers the plan hands them.

A layer goes to torchao when ``nn.torchao_recipes.torchao_recipe`` finds a torchao module that computes its plan
and ``layer_backends`` chose it. The modules are torchtitan's own classes over torchao's
(``components/quantization/float8.py`` ``Float8Linear``, ``mx.py`` ``MXFP8Linear``, ``nvfp4.py``
``NVFP4Linear``), subclassed here to carry the layer's plan and torchao's options; torchtitan's *converters* are not used, because they

- refuse on a CPU (``has_cuda_capability`` checks), so torchao's emulated modes could not be tested here;
- refuse Float8 emulate together with torch.compile, which trains on CPU with torch 2.14.1 (measured:
  compiled equals eager bit for bit for all three Float8 recipes, docs/precision_plan.md);
- replace the chosen Float8 recipe by tensorwise whenever ``emulate`` is set, and do not expose the MXFP8
  kernel choices, the scale mode or ``wgrad_with_hp``.

Whatever builds torchao's low-bit modules here also applies torchao's guard against Triton's fp8-store
miscompile (``compat.guard_fp8_stores``), which torchao itself applies only in ``convert_to_float8_training``:
our module classes in their constructor, and the launcher for every torchao module of the model config tree
(``guard_torchao_modules``: ours and those a base's torchtitan converter put there).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field

import torch
from torchtitan.components.quantization.float8 import Float8Linear as _TitanFloat8Linear
from torchtitan.components.quantization.mx import MXFP8Linear as _TitanMXFP8Linear
from torchtitan.components.quantization.nvfp4 import NVFP4Linear as _TitanNVFP4Linear
from torchtitan.tools.logging import logger

from low_bits_training.config.quantize import TorchaoOptions
from low_bits_training.nn import LinearPlan, torchao_modules
from low_bits_training.nn.hardware import detect_hardware
from low_bits_training.nn.torchao_recipes import TorchaoRecipe, torchao_recipe
from low_bits_training.plan.backends import mxfp8_dim1_kernel
from low_bits_training.titan.platform.compat import dtensor_local_tensor, guard_fp8_stores


def float8_config(recipe: TorchaoRecipe, opts: TorchaoOptions, emulate: bool):
    """torchao's ``Float8LinearConfig`` for a Float8 ``recipe`` with ``[quantize.torchao]``'s switches
    (``nn.torchao_modules.float8_config``)."""
    return torchao_modules.float8_config(
        recipe,
        emulate,
        fast_accum_forward=opts.float8_fast_accum_forward,
        fsdp_float8_all_gather=opts.enable_fsdp_float8_all_gather,
        pad_inner_dim=opts.pad_inner_dim,
    )


def float8_label(ao_config) -> str:
    """torchao's recipe name of a ``Float8LinearConfig`` ("tensorwise", "rowwise", ...), or "custom"."""
    from torchao.float8.config import Float8LinearConfig, Float8LinearRecipeName

    plain = dataclasses.replace(ao_config, emulate=False)
    for name in Float8LinearRecipeName:
        if plain == Float8LinearConfig.from_recipe_name(name):
            return name.value
    return "custom"


class TorchaoFloat8Linear(_TitanFloat8Linear):
    """torchtitan's ``Float8Linear`` (torchao's module + the Module protocol) carrying the layer's plan."""

    @dataclass(kw_only=True, slots=True)
    class Config(_TitanFloat8Linear.Config):
        plan: LinearPlan = field(default_factory=LinearPlan)
        """The layer's plan (numerics torchao computes; backends ``torchao`` / ``torchao_emulated``)."""

    def __init__(self, config: Config):
        guard_fp8_stores()  # before anything of this module is compiled (see the module doc)
        super().__init__(config)
        if self.config.enable_fsdp_float8_all_gather:
            # What torchao's Float8Linear.from_float does; torchtitan's module class skips it. The wrapper
            # makes FSDP2 all-gather the weight in fp8 (torchao float8/fsdp_utils.py).
            from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

            w = WeightWithDynamicFloat8CastTensor(
                self.weight, self.linear_mm_config, self.config.cast_config_weight.target_dtype
            )
            self.weight = torch.nn.Parameter(w, requires_grad=self.weight.requires_grad)


class TorchaoMXFP8Linear(_TitanMXFP8Linear):
    """torchtitan's ``MXFP8Linear`` with torchao's options: kernel preference, scale mode, high-precision
    weight gradient, and the dim0 / dim1 cast kernels (torchao's own forward hard-codes the last two;
    ``nn.torchao_modules.mxfp8_mm`` passes them)."""

    @dataclass(kw_only=True, slots=True)
    class Config(_TitanMXFP8Linear.Config):
        plan: LinearPlan = field(default_factory=LinearPlan)
        """The layer's plan (numerics torchao computes; backends ``torchao`` / ``torchao_emulated``)."""
        kernels: torchao_modules.MXFP8Kernels = field(default_factory=torchao_modules.MXFP8Kernels)
        """How torchao runs the layer (emulated or not, scale mode, high-precision wgrad, cast kernels); the
        dim-1 cast kernel asked for, which the module swaps for one this process can run unless emulated."""

    def __init__(self, config: Config):
        guard_fp8_stores()  # MXFP8's dim-1 cast writes transposed fp8 bytes too
        super().__init__(config)
        kernels = config.kernels
        if not kernels.emulated:
            dim1 = available_dim1_kernel(kernels.dim1_cast_kernel)
            kernels = dataclasses.replace(kernels, dim1_cast_kernel=dim1)
        self.kernels = kernels
        # torchao's own attributes, kept true for anything that inspects them (forward reads self.kernels).
        self.kernel_preference, self.scale_calculation_mode = self.kernels.torchao_enums()[:2]
        self.wgrad_with_hp = kernels.wgrad_high

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        out = torchao_modules.mxfp8_mm(input, self.weight, self.kernels)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class TorchaoNVFP4Linear(_TitanNVFP4Linear):
    """torchtitan's ``NVFP4Linear`` (torchao's ``NVFP4Linear`` + the Module protocol: meta init, per-rank SR
    seed, TP layouts) carrying the layer's plan, whose wgrad RHT signs it passes to torchao's kernels.

    torchao's module has no switch but the sign vector (``nn.torchao_recipes.nvfp4_mismatch`` maps each of our
    options to what its kernels do); torchtitan's class fixes the vector to TE's, which is what recipe
    ``nvfp4_torchao`` names. The plan's vector is the one given to torchao here all the same (``rht_sign_vector``
    is what torchao's forward reads), so a plan with other fixed signs runs them too.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(_TitanNVFP4Linear.Config):
        plan: LinearPlan = field(default_factory=LinearPlan)
        """The layer's plan (numerics torchao computes; backends ``torchao``: torchao has no emulated mode)."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.plan_signs = torchao_recipe(config.plan).rht_signs

    @property
    def rht_sign_vector(self) -> tuple[int, ...]:
        """The plan's RHT signs: what torchao's ``nvfp4_linear`` rotates both wgrad operands with."""
        return self.plan_signs


@functools.cache
def available_dim1_kernel(requested: str) -> str:
    """The MXFP8 dim-1 cast kernel this process can run for ``requested`` (``plan.backends.mxfp8_dim1_kernel``
    on the detected hardware), logged once when it differs: torchao itself only warns at import when its CUDA
    extension is missing, and the first backward would then raise."""
    kernel, why = mxfp8_dim1_kernel(requested, detect_hardware())
    if why:
        logger.warning(f"torchao MXFP8: {why}")
    return kernel


TORCHAO_CONFIGS = (TorchaoFloat8Linear.Config, TorchaoMXFP8Linear.Config, TorchaoNVFP4Linear.Config)
"""Config classes of the layers this backend builds (for walking the model config tree)."""
_TITAN_QUANTIZATION = "torchtitan.components.quantization."
"""The package of torchtitan's torchao module classes (Float8 / MXFP8 / NVFP4 linears and grouped experts)."""


def torchao_modules_in(model_config) -> list[str]:
    """FQNs of the modules of a model config tree that torchao's low-bit kernels run: this backend's
    (``TORCHAO_CONFIGS``) and those torchtitan's quantization converters swapped in."""
    from torchtitan.config import Configurable

    return [
        fqn
        for fqn, cfg, _, _ in model_config.traverse(Configurable.Config, recurse=True)
        if any(c.__module__.startswith(_TITAN_QUANTIZATION) for c in type(cfg).__mro__)
    ]  # ours subclass torchtitan's classes; so do wrappers such as LoRA's frozen configs


def guard_torchao_modules(model_config) -> bool:
    """Apply torchao's fp8-store guard (``compat.guard_fp8_stores``) when the model has torchao modules.

    Returns:
        True when it has (the guard is then applied).
    """
    found = bool(torchao_modules_in(model_config))
    if found:
        guard_fp8_stores()
    return found


def layer_config(linear_cfg, plan: LinearPlan, opts: TorchaoOptions):
    """The torchao module config replacing one ``Linear.Config`` whose plan torchao computes.

    Args:
        linear_cfg: the ``Linear.Config`` (features, bias, param_init, sharding_config are kept).
        plan: its resolved plan (backends ``torchao`` or ``torchao_emulated``).
        opts: ``[quantize.torchao]``.

    Returns:
        A ``TorchaoFloat8Linear.Config``, ``TorchaoMXFP8Linear.Config`` or ``TorchaoNVFP4Linear.Config``.

    Raises:
        ValueError: the plan has no torchao recipe (``resolve_plan`` never routes such a layer here).
    """
    recipe = torchao_recipe(plan)
    if recipe is None:
        raise ValueError(f"no torchao module computes this plan: {plan}")
    emulated = plan.backends[0] == "torchao_emulated"
    common = {
        "in_features": linear_cfg.in_features,
        "out_features": linear_cfg.out_features,
        "bias": linear_cfg.bias,
        "param_init": linear_cfg.param_init,
        "sharding_config": linear_cfg.sharding_config,
        "plan": plan,
    }
    if recipe.module == "Float8Linear":
        if any(c and c[1] == "axiswise" for c in recipe.float8_casts):
            # What torchtitan's Float8 converter does for rowwise (pytorch/pytorch#150859): inductor then
            # rounds through the cast dtypes as eager does. A process-wide inductor switch.
            torch._inductor.config.emulate_precision_casts = True
        return TorchaoFloat8Linear.Config(**common, _torchao_config=float8_config(recipe, opts, emulated))
    if recipe.module == "NVFP4Linear":
        return TorchaoNVFP4Linear.Config(
            **common
        )  # no options: torchao's NVFP4 module has none but the signs
    kernels = torchao_modules.mxfp8_kernels(
        recipe, emulated, opts.mxfp8_dim0_cast_kernel, opts.mxfp8_dim1_cast_kernel
    )
    return TorchaoMXFP8Linear.Config(**common, kernels=kernels)


def install_fsdp_scale_precompute(config) -> None:
    """With ``precompute_float8_dynamic_scale_for_fsdp``: after every optimizer step, compute all fp8 weight
    scales in one all-reduce (torchao's ``precompute_float8_dynamic_scale_for_fsdp``), chained after any
    ``post_optimizer_build_fn`` the model spec already has."""
    if not config.quantize.torchao.precompute_float8_dynamic_scale_for_fsdp:
        return
    spec = config.model_spec
    previous = spec.post_optimizer_build_fn

    def post_optimizer_build(optimizers, model_parts, parallel_dims) -> None:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        if previous is not None:
            previous(optimizers, model_parts, parallel_dims)

        def precompute(*_args, **_kwargs) -> None:
            for part in model_parts:
                precompute_float8_dynamic_scale_for_fsdp(part)

        optimizers.register_step_post_hook(precompute)
        n = sum(_is_fp8_all_gather_weight(m) for part in model_parts for m in part.modules())
        logger.info(
            f"torchao: FSDP2 all-gathers {n} weights in fp8; their scales are precomputed after each step"
        )

    config.model_spec = dataclasses.replace(spec, post_optimizer_build_fn=post_optimizer_build)


def _is_fp8_all_gather_weight(module: torch.nn.Module) -> bool:
    # What torchao's precompute_float8_dynamic_scale_for_fsdp looks for: an FSDP2 (DTensor) weight whose local
    # shard is torchao's fp8 all-gather wrapper.
    from torch.distributed.tensor import DTensor
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    w = getattr(module, "weight", None)
    return isinstance(w, DTensor) and isinstance(dtensor_local_tensor(w), WeightWithDynamicFloat8CastTensor)
