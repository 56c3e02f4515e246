"""Recipe ``nvfp4_torchao`` routed to torchao's NVFP4 training module (``NVFP4Linear``) on SM100 (issue 38):
which plans torchao's module takes, why a layer stays ours, and the module built with the plan's sign vector.
Nothing of torchao's NVFP4 kernels runs here (Triton, CUDA only): the hardware is simulated."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from low_bits_training.formats.hadamard import NAMED_SIGNS, sign_vector
from low_bits_training.nn import LinearPlan
from low_bits_training.nn.hardware import Hardware
from low_bits_training.nn.recipes import RECIPES
from low_bits_training.nn.torchao_recipes import nvfp4_mismatch, torchao_recipe
from low_bits_training.plan.backends import fallback_reason, layer_backends
from low_bits_training.plan.resolve import LayerShape

B200, H100 = Hardware("cuda", (10, 0)), Hardware("cuda", (9, 0))
TE_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)  # issue 38, from TE's source
AO = ("torchao",) * 3
OURS = ("emulate",) * 3


def _plan(**roles) -> LinearPlan:
    """nvfp4_torchao with some roles' fields replaced: role name -> dict of fields, or None (high)."""
    specs = dict(RECIPES["nvfp4_torchao"])
    for role, fields in roles.items():
        specs[role.replace("__", ".")] = (
            None if fields is None else dataclasses.replace(specs[role.replace("__", ".")], **fields)
        )
    return LinearPlan.from_roles(specs)


def test_the_recipe_is_torchaos_nvfp4_module_with_tes_signs():
    recipe = torchao_recipe(LinearPlan.from_recipe("nvfp4_torchao"))
    assert (recipe.module, recipe.label, recipe.rht_signs) == ("NVFP4Linear", "nvfp4_torchao", TE_SIGNS)
    assert NAMED_SIGNS["te"] == TE_SIGNS
    assert (recipe.min_capability, recipe.dim_multiple) == ((10, 0), 128)
    assert not recipe.has_emulated_mode and recipe.needs_triton


@pytest.mark.parametrize(
    "hw, setting, shape, backends, why",
    [
        (B200, "auto", (256, 768), AO, None),
        (B200, "torchao", (256, 768), AO, None),
        (H100, "torchao", (256, 768), OURS, "emulated: NVFP4Linear kernels need CUDA SM100+, this is CUDA SM90"),
        (Hardware(), "auto", (256, 768), OURS, "emulated: NVFP4Linear kernels need CUDA SM100+, this is CPU"),
        (Hardware("cuda", (10, 0), triton=False), "auto", (256, 768), OURS,
         "emulated: NVFP4Linear kernels are Triton, and Triton is not available here"),
        (Hardware("cuda", (10, 0), torchao=False), "auto", (256, 768), OURS, "emulated: torchao is not installed"),
        (B200, "auto", (256, 96), OURS, "emulated: NVFP4Linear needs features divisible by 128 per TP shard, got 256x96"),
        (B200, "emulate", (256, 768), OURS, None),
    ],
)  # fmt: skip
def test_routing_and_the_fallback_line(hw, setting, shape, backends, why):
    plan = LinearPlan.from_recipe("nvfp4_torchao")
    assert layer_backends(plan, setting, hw, *shape) == backends
    assert fallback_reason(plan, LayerShape(*shape), hw, setting) == why


def test_tensor_parallel_layers_stay_ours():
    plan = LinearPlan.from_recipe("nvfp4_torchao")
    assert layer_backends(plan, "auto", B200, 256, 768, tp=2) == OURS
    assert fallback_reason(plan, LayerShape(256, 768, tp=2), B200, "auto") == (
        "emulated: torchao modules are not wired for tensor parallelism here (emulation is)"
    )


@pytest.mark.parametrize(
    "roles, differs",
    [
        ({"forward__input": {"rounding": "stochastic"}}, "forward.input rounding 'stochastic' (torchao: 'nearest')"),
        ({"wgrad__input": {"rht_output": "fp32"}, "wgrad__grad_output": {"rht_output": "fp32"}},
         "wgrad.grad_output rht_output 'fp32' (torchao: 'bf16')"),
        ({"dgrad__weight": {"scaling": "block"}}, "dgrad.weight scaling 'block' (torchao: 'tile'), axis 0 (torchao: -1)"),
        ({"wgrad__input": None, "wgrad__grad_output": None}, "wgrad.grad_output high precision (torchao quantizes it)"),
        ({"forward__weight": {"scale_min": "subnormal"}},
         "forward.weight scale_min 'subnormal' (torchao: 'normal')"),
    ],
)  # fmt: skip
def test_a_role_torchao_cannot_express_stays_ours_and_is_named(roles, differs):
    plan = _plan(**roles)
    assert nvfp4_mismatch(plan) == differs and torchao_recipe(plan) is None
    assert layer_backends(plan, "torchao", B200, 256, 768) == OURS
    assert fallback_reason(plan, LayerShape(256, 768), B200, "auto") == (
        "emulated: torchao has no training module for this NVFP4 (NVFP4Linear computes recipe nvfp4_torchao; "
        f"here {differs})"
    )


def test_any_fixed_sign_vector_is_passed_to_torchao():
    seeded = {"rht_signs": "seeded", "rht_seed": 7}
    plan = _plan(wgrad__input=seeded, wgrad__grad_output=seeded)
    assert nvfp4_mismatch(plan) is None
    assert torchao_recipe(plan).rht_signs == sign_vector(16, 7) != TE_SIGNS


def test_the_module_built_takes_the_plans_signs():
    from torchao.prototype.moe_training.nvfp4_training.nvfp4_training import NVFP4Linear
    from torchtitan.models.common.linear import Linear

    from low_bits_training.config.quantize import TorchaoOptions
    from low_bits_training.nn.torchao_modules import torchao_linear
    from low_bits_training.titan.targets.torchao_backend import TorchaoNVFP4Linear, layer_config

    seeded = {"rht_signs": "seeded", "rht_seed": 7}
    for plan, signs in ((LinearPlan.from_recipe("nvfp4_torchao"), TE_SIGNS), (_plan(wgrad__input=seeded, wgrad__grad_output=seeded), sign_vector(16, 7))):  # fmt: skip
        plan = dataclasses.replace(plan, backends=AO)
        cfg = layer_config(
            Linear.Config(in_features=256, out_features=384, bias=False), plan, TorchaoOptions()
        )
        assert type(cfg) is TorchaoNVFP4Linear.Config
        with torch.device("meta"):
            module = cfg.build()
        assert isinstance(module, NVFP4Linear) and module.rht_sign_vector == signs  # what its forward reads
        lin = torch.nn.Linear(256, 384, bias=False)
        plain = torchao_linear(lin, plan, emulated=False)  # the GPU check's module
        assert type(plain) is NVFP4Linear and plain.rht_sign_vector == signs and plain.weight is lin.weight
    with pytest.raises(ValueError, match="no emulated mode"):
        torchao_linear(torch.nn.Linear(256, 384), LinearPlan.from_recipe("nvfp4_torchao"), emulated=True)


def test_expert_weights_stay_ours_with_the_reason():
    plan = LinearPlan.from_recipe("nvfp4_torchao")
    experts = LayerShape(256, 512, tokens_multiple=0, kind="experts")
    assert layer_backends(plan, "torchao", B200, 256, 512, grouped=True) == OURS
    assert fallback_reason(plan, experts, B200, "auto") == (
        "emulated: torchao has no grouped training module for NVFP4 (torchao 0.18's NVFP4 module is a dense "
        "linear only)"
    )
