"""Which backend runs each GEMM: torchao recipe matching, hardware, shapes, converted bases, the plan table."""

import dataclasses

import pytest

from low_bits_training.config.quantize import QuantizeConfig, QuantRule, TorchaoOptions
from low_bits_training.config.tree import build_dataclass
from low_bits_training.errors import ConfigError
from low_bits_training.formats import QuantSpec
from low_bits_training.nn import GEMMS, LinearPlan
from low_bits_training.nn.hardware import Hardware
from low_bits_training.nn.recipes import RECIPES
from low_bits_training.nn.torchao_recipes import torchao_recipe
from low_bits_training.plan.backends import gemm_backend
from low_bits_training.plan.resolve import LayerShape, resolve_plan
from low_bits_training.plan.table import format_plan, plan_to_json

LAYERS = {f"layers.{i}.w": LayerShape(256, 768, 256) for i in range(2)}
LAYERS["lm_head"] = LayerShape(256, 2048, 256)
CPU, H100, B200 = Hardware(), Hardware("cuda", (9, 0)), Hardware("cuda", (10, 0))


def backends(cfg: QuantizeConfig, hw: Hardware, fqn: str = "layers.0.w", layers=LAYERS) -> tuple[str, ...]:
    plan = resolve_plan(cfg, layers, hw)[fqn]
    return tuple(gemm_backend(plan, g) for g in GEMMS)


@pytest.mark.parametrize(
    ("recipe", "label"),
    [
        ("fp8_tensorwise", "Float8Linear tensorwise"),
        ("fp8_rowwise", "Float8Linear rowwise"),
        ("fp8_rowwise_hp_wgrad", "Float8Linear rowwise_with_gw_hp"),
        ("mxfp8", "MXFP8Linear mxfp8 rceil"),
        ("deepseek_fp8", None),
        ("mxfp6", None),
        ("mxfp4", None),
        ("nvfp4", None),  # torchao's NVFP4Linear adds a random Hadamard transform no QuantSpec expresses
        ("int8", None),
        ("bf16", None),
    ],
)
def test_recipe_to_torchao_module(recipe, label):
    got = torchao_recipe(LinearPlan.from_roles(RECIPES[recipe]))
    assert (None if got is None else f"{got.module} {got.label}") == label


def test_variants_torchao_has_and_has_not():
    mx_floor = {r: QuantSpec.mxfp8("e4m3", "floor") for r in RECIPES["mxfp8"]}
    assert torchao_recipe(LinearPlan.from_roles(mx_floor)).mx_scale_mode == "floor"
    hp_wgrad = {**RECIPES["mxfp8"], "wgrad.grad_output": None, "wgrad.input": None}
    assert torchao_recipe(LinearPlan.from_roles(hp_wgrad)).wgrad_high
    e5m2_grads = {
        **RECIPES["fp8_rowwise"],
        "dgrad.grad_output": QuantSpec.fp8_rowwise("e5m2", scale_rounding="rceil"),
    }
    e5m2_grads["wgrad.grad_output"] = e5m2_grads["dgrad.grad_output"]
    assert (
        torchao_recipe(LinearPlan.from_roles(e5m2_grads)).label == "custom"
    )  # a Float8 cast table all the same
    refused = [
        {
            **RECIPES["fp8_rowwise"],
            "dgrad.grad_output": QuantSpec.fp8_rowwise("e5m2", scale_rounding="rceil"),
        },
        {**RECIPES["fp8_rowwise"], "wgrad.input": None},  # one wgrad operand high, the other fp8
        {**RECIPES["fp8_rowwise"], "forward.input": QuantSpec.fp8_rowwise()},  # exact scales beside rceil
        {
            **RECIPES["fp8_tensorwise"],
            "dgrad.grad_output": QuantSpec.fp8_tensorwise("e5m2", rounding="stochastic"),
        },
        {**RECIPES["mxfp8"], "forward.input": QuantSpec.mxfp8("e4m3", "floor")},
    ]
    for specs in refused:
        assert torchao_recipe(LinearPlan.from_roles(specs)) is None
    # The corner-case options of the emulation do not change which torchao module computes the plan.
    nan = {
        r: None if s is None else dataclasses.replace(s, inf_amax="nan")
        for r, s in RECIPES["fp8_rowwise"].items()
    }
    assert torchao_recipe(LinearPlan.from_roles(nan)).label == "rowwise"


@pytest.mark.parametrize(
    ("setting", "hw", "recipe", "want"),
    [
        ("auto", CPU, "fp8_rowwise", ("emulate",) * 3),
        ("auto", H100, "fp8_rowwise", ("torchao",) * 3),
        ("auto", H100, "mxfp8", ("emulate",) * 3),  # no MX kernels before SM100
        ("auto", B200, "mxfp8", ("torchao",) * 3),
        ("auto", B200, "nvfp4", ("emulate",) * 3),
        ("auto", H100, "fp8_rowwise_hp_wgrad", ("torchao",) * 3),
        ("torchao", CPU, "fp8_tensorwise", ("torchao_emulated",) * 3),
        ("torchao", H100, "mxfp8", ("torchao_emulated",) * 3),
        ("emulate", B200, "mxfp8", ("emulate",) * 3),
        ("emulate", CPU, "fp8_rowwise_hp_wgrad", ("emulate", "emulate", "high")),
        ("auto", H100, "bf16", ("high",) * 3),
    ],
)
def test_backend_per_gemm(setting, hw, recipe, want):
    assert backends(QuantizeConfig(recipe=recipe, backend=setting), hw) == want
    assert backends(QuantizeConfig(recipe=recipe, backend=setting), hw, "lm_head") == ("high",) * 3


def test_shapes_and_parallelism_torchao_cannot_take_stay_emulated():
    odd = {"layers.0.w": LayerShape(200, 768, 256)}  # 200: not a multiple of 16
    assert backends(QuantizeConfig(recipe="fp8_rowwise", skip=[]), H100, layers=odd) == ("emulate",) * 3
    tp = {"layers.0.w": LayerShape(256, 768, 256, tp=2)}
    assert backends(QuantizeConfig(recipe="fp8_rowwise", skip=[]), H100, layers=tp) == ("emulate",) * 3
    mixed = QuantizeConfig(
        recipe="fp8_rowwise", rules=[QuantRule(layers=["layers.1.*"], rounding="stochastic")]
    )
    assert backends(mixed, H100, "layers.0.w") == ("torchao",) * 3
    assert backends(mixed, H100, "layers.1.w") == ("emulate",) * 3


def test_torchao_options_checked_against_the_plan():
    ag = TorchaoOptions(enable_fsdp_float8_all_gather=True)
    resolve_plan(QuantizeConfig(recipe="fp8_tensorwise", torchao=ag), LAYERS, H100)
    with pytest.raises(
        ConfigError, match="layers.0.w scales its weight axiswise .rowwise.; torchao all-gathers"
    ):
        resolve_plan(QuantizeConfig(recipe="fp8_rowwise", torchao=ag), LAYERS, H100)
    resolve_plan(QuantizeConfig(recipe="fp8_rowwise", torchao=ag), LAYERS, CPU)  # all ours: nothing to gather
    with pytest.raises(ConfigError, match="'torchao': torchao is not installed"):
        resolve_plan(QuantizeConfig(backend="torchao"), LAYERS, Hardware(torchao=False))
    cfg = build_dataclass(QuantizeConfig, {"torchao": {"mxfp8_dim1_cast_kernel": "torch"}}, "quantize")
    assert cfg.torchao.mxfp8_dim1_cast_kernel == "torch"
    with pytest.raises(ConfigError, match="quantize.torchao.mxfp8_dim1_cast_kernel"):
        build_dataclass(QuantizeConfig, {"torchao": {"mxfp8_dim1_cast_kernel": "cudnn"}}, "quantize")


def test_layers_a_torchtitan_converter_swapped():
    converted = {"lm_head": "torchtitan Float8Linear", "layers.1.w": "torchtitan Float8Linear"}
    covered = {"layers.0.w": LAYERS["layers.0.w"]}
    plans = resolve_plan(QuantizeConfig(recipe="mxfp8"), covered, CPU, converted)  # default skip: lm_head
    assert list(plans) == ["layers.0.w"] and not plans["layers.0.w"].is_high_precision
    with pytest.raises(ConfigError) as e:
        resolve_plan(QuantizeConfig(rules=[QuantRule(layers=["layers.1.*"])]), covered, CPU, converted)
    assert "matches only layers the base's torchtitan converter already swapped" in str(e.value)
    with pytest.raises(
        ConfigError, match="'nope' matches no linear layer; layers are layers.0.w, lm_head, layers.1.w"
    ):
        resolve_plan(QuantizeConfig(skip=["nope"]), covered, CPU, converted)


def test_table_shows_modules_and_backends():
    plans = resolve_plan(QuantizeConfig(recipe="fp8_rowwise", backend="torchao"), LAYERS, CPU)
    plans["layers.9.x"] = LinearPlan(backends=("torchtitan",) * 3)
    modules = {f: "torchao Float8Linear (rowwise)" for f in ("layers.0.w", "layers.1.w")}
    modules |= {"lm_head": "Linear", "layers.9.x": "torchtitan Float8Linear (tensorwise, emulate)"}
    text = format_plan(plans, modules)
    first = next(line for line in text.splitlines() if line.startswith("layers.[0-1].w"))
    assert first.split()[1:6] == [
        "torchao",
        "Float8Linear",
        "(rowwise)",
        "forward.input",
        "e4m3/axis-1(fp32,rceil)/rne",
    ]
    assert "torchao_emulated" in text
    row = next(line for line in text.splitlines() if line.startswith("layers.[9].x"))
    assert row.split()[-1] == "torchtitan" and "the base's torchtitan converter" in row
    data = plan_to_json(plans, modules)
    assert data["layers.0.w"]["backends"] == {
        "forward": "torchao_emulated",
        "dgrad": "torchao_emulated",
        "wgrad": "torchao_emulated",
    }
    assert data["lm_head"]["backends"]["forward"] == "high" and data["layers.9.x"]["module"].startswith(
        "torchtitan"
    )


def test_torchao_corner_case_options_from_toml_rules():
    cfg = build_dataclass(
        QuantizeConfig, {"recipe": "nvfp4", "rules": [{"scale_min": "normal", "inf_amax": "nan"}]}, "quantize"
    )
    plans = resolve_plan(cfg, LAYERS)
    assert (
        plans["layers.0.w"].spec("forward.input").short() == "e2m1/block16(ue4m3,exact+t32,minN,infNaN)/rne"
    )
    with pytest.raises(
        ConfigError, match=r"^quantize.rules\[0\].scale_min = 'tiny': expected one of subnormal, normal$"
    ):
        build_dataclass(QuantizeConfig, {"recipe": "mxfp8", "rules": [{"scale_min": "tiny"}]}, "quantize")
