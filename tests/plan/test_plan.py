"""The [quantize] precision plan: recipes, rules, skip, backends, and one-line errors before the model."""

import pytest

from low_bits_training.config.quantize import QuantizeConfig, QuantRule, TorchaoOptions
from low_bits_training.config.tree import build_dataclass
from low_bits_training.errors import ConfigError
from low_bits_training.formats import QuantSpec
from low_bits_training.nn import ROLES, LinearPlan
from low_bits_training.nn.recipes import RECIPES
from low_bits_training.plan.resolve import LayerShape, resolve_plan
from low_bits_training.plan.table import format_plan, plan_to_json

LAYERS = {
    f"layers.{i}.{n}": LayerShape(256, 768 if n == "feed_forward.w1" else 256, 256)
    for i in range(4)
    for n in ("attention.wqkv", "feed_forward.w1")
}
LAYERS["lm_head"] = LayerShape(256, 2048, 256)


def spec(plans, fqn, role):
    s = plans[fqn].spec(role)
    return None if s is None else s.short()


def test_recipe_defaults_and_skip():
    plans = resolve_plan(QuantizeConfig(recipe="fp8_tensorwise"), LAYERS)
    assert spec(plans, "layers.0.attention.wqkv", "forward.input") == "e4m3/tensor(fp32,exact)/rne"
    assert spec(plans, "layers.3.feed_forward.w1", "dgrad.grad_output").startswith("e5m2/tensor")
    assert plans["lm_head"].is_high_precision  # default skip
    assert all(p.is_high_precision for p in resolve_plan(QuantizeConfig(), LAYERS).values())


def test_rules_apply_in_order_with_first_last_n():
    cfg = QuantizeConfig(
        recipe="mxfp8",
        rules=[
            QuantRule(first_n=1, last_n=1, roles=["wgrad.*"], format="e5m2"),
            QuantRule(layers=["layers.3.*"], roles=["*.weight"], format="high"),
            QuantRule(roles=["dgrad.grad_output"], rounding="stochastic"),
        ],
    )
    plans = resolve_plan(cfg, LAYERS)
    assert spec(plans, "layers.0.feed_forward.w1", "wgrad.input") == "e5m2/block32@0(e8m0,rceil)/rne"
    assert spec(plans, "layers.1.feed_forward.w1", "wgrad.input") == "e4m3/block32@0(e8m0,rceil)/rne"
    assert spec(plans, "layers.3.attention.wqkv", "wgrad.grad_output").startswith("e5m2")
    assert spec(plans, "layers.3.attention.wqkv", "forward.weight") is None
    assert spec(plans, "layers.2.attention.wqkv", "dgrad.grad_output").endswith("/sr")
    assert plans["lm_head"].is_high_precision  # skip wins over rules


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: QuantizeConfig(recipe="fp9"),
            "quantize.recipe = 'fp9': expected one of bf16, fp8_tensorwise",
        ),
        (
            lambda: QuantizeConfig(backend="gpu"),
            "quantize.backend = 'gpu': expected one of emulate, torchao, auto",
        ),
        (
            lambda: QuantizeConfig(rules=[QuantRule(format="e9m9")]),
            "quantize.rules[0]: unknown format 'e9m9'",
        ),
        (
            lambda: QuantizeConfig(rules=[QuantRule(layers=["layers.*.attn.*"])]),
            "quantize.rules[0].layers: 'layers.*.attn.*'",
        ),
        (
            lambda: QuantizeConfig(rules=[QuantRule(roles=["backward.*"])]),
            "quantize.rules[0].roles: 'backward.*' matches no",
        ),
        (
            lambda: QuantizeConfig(rules=[QuantRule(first_n=9)]),
            "quantize.rules[0].first_n/last_n = 9/0: expected 0..4",
        ),
        (
            lambda: QuantizeConfig(rules=[QuantRule(format="e4m3", scaling="rows")]),
            "quantize.rules.scaling = 'rows': expected one of none, tensor, axis, block, tile",
        ),
        (lambda: QuantizeConfig(skip=["output"]), "quantize.skip: 'output' matches no linear layer"),
        (
            lambda: QuantizeConfig(recipe="mxfp8", rules=[QuantRule(block_size=48)]),
            "block_size=48 does not divide",
        ),
        (
            lambda: QuantizeConfig(recipe="mxfp8", backend="real"),
            "quantize.backend = 'real': expected one of emulate, torchao, auto (the hand-written _scaled_mm",
        ),
        (
            lambda: QuantizeConfig(torchao=TorchaoOptions(precompute_float8_dynamic_scale_for_fsdp=True)),
            "quantize.torchao.precompute_float8_dynamic_scale_for_fsdp = true needs",
        ),
    ],
)
def test_one_line_errors(make, message):
    # Each refused when the section is built (a value that fits no field type) or when it is resolved
    # against the layers (globs, shapes, options); either way before any model exists.
    with pytest.raises(ConfigError) as e:
        resolve_plan(make(), LAYERS)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_block_must_fit_tp_shards_and_tokens():
    layers = {"layers.0.w": LayerShape(256, 192, 256, tp=2)}  # 192 / 2 = 96: not a multiple of 64
    with pytest.raises(ConfigError, match=r"block_size=64 does not divide dim 1 of size 96"):
        resolve_plan(QuantizeConfig(recipe="mxfp8", skip=[], rules=[QuantRule(block_size=64)]), layers)
    with pytest.raises(ConfigError, match=r"wgrad.grad_output \(100, 256\)"):
        resolve_plan(QuantizeConfig(recipe="mxfp8", skip=[]), {"layers.0.w": LayerShape(256, 256, 100)})


def test_toml_shape_builds_through_the_tree_layer():
    cfg = build_dataclass(
        QuantizeConfig,
        {"recipe": "nvfp4", "rules": [{"layers": ["layers.0.*"], "roles": ["*"], "format": "high"}]},
        "quantize",
    )
    plans = resolve_plan(cfg, LAYERS)
    assert plans["layers.0.attention.wqkv"].is_high_precision
    assert spec(plans, "layers.1.attention.wqkv", "forward.weight") == "e2m1/tile16x16(ue4m3,exact+t32)/rne"
    with pytest.raises(ConfigError, match="unknown key 'quantize.rules\\[0\\].format_'"):
        build_dataclass(QuantizeConfig, {"rules": [{"format_": "e4m3"}]}, "quantize")


def test_table_collapses_identical_layers():
    text = format_plan(resolve_plan(QuantizeConfig(recipe="fp8_rowwise"), LAYERS))
    assert "layers.[0-3].attention.wqkv" in text and "layers.[0-3].feed_forward.w1" in text
    assert "e4m3/axis0(fp32,rceil)/rne" in text and len(text.splitlines()) == 2 + 6 + 1
    data = plan_to_json(resolve_plan(QuantizeConfig(recipe="int8"), LAYERS))
    assert data["layers.0.attention.wqkv"]["specs"]["wgrad.input"]["axis"] == 0


def test_every_recipe_resolves_on_the_debug_shapes():
    for name in RECIPES:
        resolve_plan(QuantizeConfig(recipe=name), LAYERS)


@pytest.mark.parametrize("name", list(RECIPES))
def test_python_recipe_plan_is_the_resolved_toml_plan(name):
    # LinearPlan.from_recipe (Python, no TOML) gives a layer exactly what [quantize] recipe = name resolves to.
    resolved = resolve_plan(QuantizeConfig(recipe=name, skip=[]), LAYERS)
    assert all(plan == LinearPlan.from_recipe(name) for plan in resolved.values())


def test_python_constructors_have_the_recipes_numerics():
    # The recipe table holds each operand's spec before the plan sets its axis to the GEMM's contraction dim.
    by_operand = {"mxfp8": [QuantSpec.mxfp8()] * 3, "mxfp4": [QuantSpec.mxfp4()] * 3}
    by_operand["mxfp6"] = [QuantSpec.mxfp6(), QuantSpec.mxfp6(), QuantSpec.mxfp6("e3m2")]
    for name, (inp, weight, grad) in by_operand.items():
        specs = {"input": inp, "weight": weight, "grad_output": grad}
        assert RECIPES[name] == {r.name: specs[r.operand] for r in ROLES}, name
    assert QuantSpec.mxfp8().scale_rounding == "rceil"  # torchao's training default (the OCP rule is floor)
    with pytest.raises(ValueError, match=r"^recipe = 'mxfp9': expected one of bf16, fp8_tensorwise,"):
        LinearPlan.from_recipe("mxfp9")


def test_a_rule_with_a_new_format_drops_the_bound_options_it_cannot_hold():
    from low_bits_training.config.quantize import QuantRule
    from low_bits_training.plan.resolve import rule_spec

    nvfp4_4over6 = QuantSpec("e2m1", "block", block_size=16, scale_format="ue4m3", four_over_six="mse")
    mx = rule_spec(QuantRule(format="e4m3", block_size=32, scale_format="e8m0"), nvfp4_4over6, "q.rules[0]")
    assert mx.four_over_six == "off" and mx.elem.name == "e4m3" and mx.block_size == 32
    delayed = QuantSpec("e4m3", "tensor", amax_history=16)
    assert rule_spec(QuantRule(format="e5m2"), delayed, "q").amax_history == 16  # it holds: kept
    blocks = rule_spec(QuantRule(format="e4m3", scaling="block", block_size=32), delayed, "q")
    assert blocks.amax_history == 0
    with pytest.raises(ConfigError, match=r"^q: .*four_over_six"):  # set by the rule itself: refused
        rule_spec(QuantRule(format="e4m3", scaling="block", four_over_six="mse"), None, "q")
