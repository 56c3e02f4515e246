"""Why a layer does not get torchao's kernel (``plan.backends.fallback_reason``), per recipe and simulated
GPU, and the MXFP8 dim-1 cast kernel checked, not assumed (issue 29)."""

from __future__ import annotations

import pytest

from low_bits_training.nn import LinearPlan
from low_bits_training.nn.hardware import Hardware, detect_hardware, mxfp8_cuda_cast_built
from low_bits_training.nn.recipes import RECIPES
from low_bits_training.plan.backends import fallback_reason, mxfp8_dim1_kernel
from low_bits_training.plan.resolve import LayerShape

CPU, H100, B200 = Hardware(), Hardware("cuda", (9, 0)), Hardware("cuda", (10, 0))
B200_NO_CAST = Hardware("cuda", (10, 0), mxfp8_cuda_cast=False)
SHAPE = LayerShape(256, 512)
NO_MODULE = "emulated: torchao has no training module for "
NVFP4 = NO_MODULE + "this NVFP4 (NVFP4Linear computes recipe nvfp4_torchao; here forward.input "
OURS = "scale_min 'subnormal' (torchao: 'normal'), scale_apply 'divide' (torchao: 'reciprocal'), scale_order 'decode' (torchao: 'torchao'))"  # fmt: skip
NVFP4_SM100 = "emulated: NVFP4Linear kernels need CUDA SM100+, this is "
FLOAT8_SM89 = "emulated: Float8Linear kernels need CUDA SM89+, this is "
MXFP8_SM100 = "emulated: MXFP8Linear kernels need CUDA SM100+, this is "
NO_CAST = (
    "torchao's MXFP8 CUDA cast (torch.ops.torchao.mxfp8_quantize) is not built into this torchao for this "
    "torch / CUDA; dim-1 casts use its triton kernel"
)
EXPECTED = {  # recipe: (CPU, H100, B200, B200 without torchao's CUDA cast)
    "bf16": (None, None, None, None),
    "fp8_tensorwise": (FLOAT8_SM89 + "CPU", None, None, None),
    "fp8_rowwise": (FLOAT8_SM89 + "CPU", None, None, None),
    "fp8_rowwise_hp_wgrad": (FLOAT8_SM89 + "CPU", None, None, None),
    "mxfp8": (MXFP8_SM100 + "CPU", MXFP8_SM100 + "CUDA SM90", None, NO_CAST),
    "deepseek_fp8": (NO_MODULE + "block scaling (size 128, fp32 scales)",) * 4,
    "fp8_block_te": (NO_MODULE + "block scaling (size 128, fp32 scales)",) * 4,
    "fp8_block_te_exact": (NO_MODULE + "block scaling (size 128, fp32 scales)",) * 4,
    "mxfp6": (NO_MODULE + "format e2m3",) * 4,
    "mxfp4": (NO_MODULE + "format e2m1",) * 4,
    "int8": (NO_MODULE + "format int8",) * 4,
    "fp8_delayed": (NO_MODULE + "delayed scaling (torchao scales from the current amax)",) * 4,
    "mxfp8_2d_weights": (NO_MODULE + "tile scaling (size 32, e8m0 scales)",) * 4,
    "fp8_rowwise_2d_weights": (NO_MODULE + "tile scaling (size 128, fp32 scales)",) * 4,
    **{r: (NVFP4 + OURS,) * 4 for r in ("nvfp4", "nvfp4_no_rht", "nvfp4_no_sr", "nvfp4_1d_weights")},
    "nvfp4_4over6": (
        NVFP4 + OURS.replace("'normal'), ", "'normal'), four_over_six 'mse' (torchao: 'off'), "),
    )
    * 4,
    "nvfp4_te": (
        NVFP4 + "scale_min 'subnormal' (torchao: 'normal'), scale_underflow 'zero' (torchao: 'clamp'), "
        "scale_order 'te' (torchao: 'torchao'))",
    )
    * 4,
    "nvfp4_torchao": (NVFP4_SM100 + "CPU", NVFP4_SM100 + "CUDA SM90", None, None),  # torchao's NVFP4Linear
}


def test_every_recipe_is_in_the_table():
    assert set(EXPECTED) == set(RECIPES)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_fallback_reason_per_recipe_and_gpu(recipe):
    plan = LinearPlan.from_roles(RECIPES[recipe])
    got = tuple(fallback_reason(plan, SHAPE, hw, "auto") for hw in (CPU, H100, B200, B200_NO_CAST))
    assert got == EXPECTED[recipe]
    assert fallback_reason(plan, SHAPE, B200, "emulate") is None  # asked for: not a fallback


def test_torchao_setting_names_torchaos_emulated_mode_and_shapes():
    plan = LinearPlan.from_recipe("fp8_rowwise")
    assert fallback_reason(plan, SHAPE, CPU, "torchao") == "torchao emulated: " + FLOAT8_SM89[10:] + "CPU"
    assert fallback_reason(plan, LayerShape(250, 512), H100, "auto") == (
        "emulated: Float8Linear needs features divisible by 16 per TP shard, got 250x512"
    )
    experts = LayerShape(256, 512, tokens_multiple=0, kind="experts")
    assert fallback_reason(LinearPlan.from_recipe("mxfp8"), experts, B200, "auto") is None
    assert fallback_reason(plan, experts, CPU, "torchao") == (  # grouped Float8 has no emulated mode
        "emulated: Float8GroupedExperts kernels need CUDA SM89+, this is CPU"
    )


def test_the_mxfp8_dim1_cast_kernel_is_checked():
    assert mxfp8_dim1_kernel("cuda", B200) == ("cuda", None)
    assert mxfp8_dim1_kernel("cuda", B200_NO_CAST) == ("triton", NO_CAST)
    no_triton = Hardware("cuda", (10, 0), mxfp8_cuda_cast=False, triton=False)
    assert mxfp8_dim1_kernel("cuda", no_triton)[0] == "torch"
    assert mxfp8_dim1_kernel("triton", no_triton)[0] == "torch"
    assert mxfp8_dim1_kernel("cuda", H100) == ("cuda", None)  # no kernel runs there: emulated mode
    assert not mxfp8_cuda_cast_built() and not detect_hardware().mxfp8_cuda_cast  # this CPU machine


def test_an_mxfp8_module_casts_with_a_kernel_that_exists(monkeypatch):
    from torchtitan.models.common.linear import Linear

    from low_bits_training.config.quantize import TorchaoOptions
    from low_bits_training.titan.targets import torchao_backend

    monkeypatch.setattr(torchao_backend, "detect_hardware", lambda: B200_NO_CAST)
    torchao_backend.available_dim1_kernel.cache_clear()
    try:
        plan = LinearPlan(LinearPlan.from_recipe("mxfp8").specs, backends=("torchao",) * 3)
        cfg = torchao_backend.layer_config(
            Linear.Config(in_features=64, out_features=64), plan, TorchaoOptions()
        )
        assert cfg.kernels.dim1_cast_kernel == "cuda" and cfg.build().kernels.dim1_cast_kernel == "triton"
    finally:
        torchao_backend.available_dim1_kernel.cache_clear()


def test_the_plan_table_says_why_each_group_of_layers_falls_back():
    # fallbacks() groups fallback_reason by reason, layer names collapsed as the plan table collapses them.
    from low_bits_training.plan.table import fallbacks, format_fallbacks

    rowwise, nvfp4 = LinearPlan.from_recipe("fp8_rowwise"), LinearPlan.from_recipe("nvfp4")
    plans = {f"layers.{i}.w": rowwise for i in range(3)} | {"layers.1.v": nvfp4, "lm_head": LinearPlan()}
    plans["layers.0.qk"] = rowwise
    shapes = dict.fromkeys(plans, SHAPE) | {"layers.0.qk": LayerShape(64, 64, kind="qk")}
    rows = fallbacks(plans, shapes, H100, "auto")
    product = "emulated: torchao has no module for attention products (Q K^T, P V)"
    assert rows == [
        (NVFP4 + OURS, ["layers.[1].v"]),
        (product, ["layers.[0].qk"]),
    ]  # rowwise runs torchao on SM90
    rows = fallbacks(plans, shapes, CPU, "auto")
    assert rows[0] == (FLOAT8_SM89 + "CPU", ["layers.[0-2].w"])
    assert format_fallbacks(rows, CPU, "auto").splitlines() == [
        "not on torchao's kernel (on CPU, backend = 'auto'):",
        f"  layers.[0-2].w: {FLOAT8_SM89}CPU",
        f"  layers.[1].v: {NVFP4}{OURS}",
        f"  layers.[0].qk: {product}",
    ]
    assert fallbacks(plans, shapes, B200, "emulate") == [] and format_fallbacks([], B200, "emulate") == ""


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_backend_torchao_refuses_a_plan_torchao_runs_none_of(recipe):
    # issue 29: backend = "torchao" on a plan torchao has no module for is one line naming key, value, reason
    # and what is allowed; a plan torchao runs (in part: the other layers stay ours, with their reason) passes.
    from low_bits_training.config.quantize import QuantizeConfig
    from low_bits_training.errors import ConfigError
    from low_bits_training.plan.resolve import resolve_plan

    layers = dict.fromkeys(
        ["layers.0.w", "layers.1.w", "lm_head"], LayerShape(256, 512, 256)
    )  # lm_head: skipped
    plan = LinearPlan.from_roles(RECIPES[recipe])
    runs = recipe == "bf16" or fallback_reason(plan, SHAPE, CPU, "torchao").startswith("torchao emulated")
    cfg = QuantizeConfig(recipe=recipe, backend="torchao")
    if (
        recipe == "nvfp4_torchao"
    ):  # torchao's NVFP4Linear has no emulated mode: a CPU emulates it (equal numbers)
        assert {p.backends for p in resolve_plan(cfg, layers, CPU).values()} == {("emulate",) * 3}
        with pytest.raises(
            ConfigError, match=r"\(layers.0.w: emulated: NVFP4Linear kernels need CUDA SM100\+, "
        ):
            resolve_plan(cfg, layers, H100)  # a GPU without the kernel is refused as for any recipe
        return
    if runs:
        resolve_plan(cfg, layers, CPU)
        return
    with pytest.raises(ConfigError) as refused:
        resolve_plan(cfg, layers, CPU)
    assert str(refused.value) == (
        f"quantize.backend = 'torchao': torchao runs none of this plan's quantized layers (layers.0.w: "
        f"{fallback_reason(plan, SHAPE, CPU, 'torchao')}); use backend 'auto' or 'emulate', or a plan torchao "
        "computes (recipes fp8_tensorwise, fp8_rowwise, fp8_rowwise_hp_wgrad, mxfp8, nvfp4_torchao)"
    )
    resolve_plan(QuantizeConfig(recipe=recipe, backend="auto"), layers, CPU)  # the same plan, ours: fine


def test_backend_torchao_keeps_a_plan_it_runs_in_part():
    from low_bits_training.config.quantize import QuantizeConfig, QuantRule
    from low_bits_training.plan.resolve import resolve_plan

    layers = dict.fromkeys(
        ["layers.0.w", "layers.1.w", "lm_head"], LayerShape(256, 512, 256)
    )  # lm_head: skipped
    rule = QuantRule(layers=["layers.0.*"], roles=["dgrad.grad_output"], rounding="stochastic")
    plans = resolve_plan(QuantizeConfig(recipe="fp8_rowwise", backend="torchao", rules=[rule]), layers, CPU)
    assert [plans[f].backends[0] for f in layers] == ["emulate", "torchao_emulated", "emulate"]
