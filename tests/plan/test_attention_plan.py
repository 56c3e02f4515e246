"""The attention products in the precision plan (plan/attention.py): only rules that name them reach them,
their shapes refuse block sizes in one line naming the rule, head_dim and seq_len, and they always emulate."""

import pytest

from low_bits_training.config.quantize import QuantizeConfig, QuantRule
from low_bits_training.errors import ConfigError
from low_bits_training.nn.hardware import Hardware
from low_bits_training.plan.resolve import LayerShape, resolve_plan
from low_bits_training.plan.table import format_plan

HEAD, SEQ = 64, 256


def layers(head: int = HEAD, seq: int = SEQ) -> dict[str, LayerShape]:
    out = {}
    for i in range(4):
        out[f"layers.{i}.attention.wqkv"] = LayerShape(256, 768, seq)
        out[f"layers.{i}.attention.qk"] = LayerShape(head, seq, seq, kind="qk")
        out[f"layers.{i}.attention.pv"] = LayerShape(seq, head, seq, kind="pv")
        out[f"layers.{i}.feed_forward.w1"] = LayerShape(256, 768, seq)
    out["lm_head"] = LayerShape(256, 2048, seq)
    return out


PRODUCTS = [f for f, s in layers().items() if s.product]
FP8 = QuantRule(layers=["*.attention.qk", "*.attention.pv"], format="e4m3", scaling="tensor")


def quantized(plans) -> set[str]:
    return {f for f, p in plans.items() if not p.is_high_precision}


@pytest.mark.parametrize(
    "rules",
    [
        [],
        [QuantRule(format="e4m3")],  # every layer
        [QuantRule(layers=["layers.*.attention.*"], format="e4m3")],  # also matches linear layers
        [QuantRule(layers=["layers.0.*"], format="e4m3")],
        [QuantRule(first_n=2, last_n=1, format="e4m3")],
    ],
    ids=["recipe", "no-layers", "attention-glob", "block-glob", "first-last-n"],
)
def test_the_recipe_and_linear_rules_leave_attention_alone(rules):
    plans = resolve_plan(QuantizeConfig(recipe="mxfp8", rules=rules), layers())
    assert set(PRODUCTS) <= set(plans)
    assert not quantized(plans) & set(PRODUCTS)
    assert "layers.0.attention.wqkv" in quantized(plans)


def test_rules_that_name_the_products_reach_them():
    cfg = QuantizeConfig(
        rules=[
            FP8,
            QuantRule(layers=["*.[qp][kv]"], roles=["*.grad_output"], format="e5m2"),
            QuantRule(layers=["layers.3.attention.pv"], format="high"),
        ],
        skip=["lm_head", "layers.0.*"],  # skip reaches products: block 0 stays high
    )
    plans = resolve_plan(cfg, layers())
    assert quantized(plans) == {f for f in PRODUCTS if f[7] in "12"} | {"layers.3.attention.qk"}
    qk = plans["layers.1.attention.qk"]
    assert qk.spec("forward.input").short() == "e4m3/tensor(fp32,exact)/rne"
    assert qk.spec("dgrad.grad_output").short() == "e5m2/tensor(fp32,exact)/rne"
    assert qk.backends == ("emulate",) * 3
    table = format_plan(plans)
    assert "layers.[1-3].attention.qk" in table and "layers.[0,3].attention.pv" in table


@pytest.mark.parametrize("backend", ["auto", "torchao"])
def test_products_always_emulate(backend):
    rule = QuantRule(layers=["*.qk", "*.pv"], format="e4m3", scaling="axis", scale_rounding="rceil")
    hw = Hardware("cuda", (9, 0))  # an H100: torchao runs fp8 rowwise
    plans = resolve_plan(QuantizeConfig(recipe="fp8_rowwise", backend=backend, rules=[rule]), layers(), hw)
    assert plans["layers.0.attention.wqkv"].backends[0].startswith("torchao")
    assert all(plans[f].backends == ("emulate",) * 3 for f in PRODUCTS)


def test_mxfp8_blocks_fit_head_dim_and_seq_len():
    mx = QuantRule(
        layers=["*.qk", "*.pv"], format="e4m3", scaling="block", block_size=32, scale_format="e8m0"
    )
    plans = resolve_plan(QuantizeConfig(rules=[mx]), layers())
    assert plans["layers.0.attention.pv"].spec("wgrad.input").short().startswith("e4m3/block32@0")


@pytest.mark.parametrize(
    ("rule", "head", "seq", "message"),
    [
        (
            QuantRule(layers=["*.qk"], format="e4m3", scaling="block", block_size=48),
            64,
            256,
            "quantize.rules[1]: layers.0.attention.qk forward.input: block_size = 48 does not divide head_dim = 64 "
            "(Q, blocked along head_dim in the forward GEMM); use a divisor of 64 or exclude the role",
        ),
        (
            QuantRule(layers=["*.pv"], roles=["forward.*"], format="e4m3", scaling="block", block_size=32),
            64,
            100,
            "quantize.rules[1]: layers.0.attention.pv forward.input: block_size = 32 does not divide seq_len = 100 "
            "(P, blocked along seq_len in the forward GEMM)",
        ),
        (
            QuantRule(layers=["*.pv"], roles=["dgrad.weight"], format="e4m3", scaling="tile", block_size=32),
            48,
            256,
            "quantize.rules[1]: layers.0.attention.pv dgrad.weight: block_size = 32 does not divide head_dim = 48 "
            "(V^T, 32-tiles in the dgrad GEMM)",
        ),
    ],
    ids=["head-dim", "seq-len", "tile"],
)
def test_block_size_errors_name_rule_and_dim(rule, head, seq, message):
    cfg = QuantizeConfig(rules=[QuantRule(layers=["*.w1"], format="e4m3"), rule])
    with pytest.raises(ConfigError) as e:
        resolve_plan(cfg, layers(head, seq))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_a_glob_for_products_that_are_not_there_is_refused():
    linears = {f: s for f, s in layers().items() if not s.product}
    with pytest.raises(ConfigError, match=r"quantize.rules\[0\].layers: '\*.qk' matches no linear layer"):
        resolve_plan(QuantizeConfig(rules=[QuantRule(layers=["*.qk"], format="e4m3")]), linears)


def test_rht_errors_name_the_attention_dim():
    rule = QuantRule(layers=["*.qk"], roles=["forward.*"], format="e4m3", scaling="tensor", rht=128)
    with pytest.raises(ConfigError, match=r"layers.0.attention.qk forward.input: rht = 128 does not divide the "
                       r"forward GEMM's contraction dim \(head_dim 64\)"):  # fmt: skip
        resolve_plan(QuantizeConfig(rules=[rule]), layers())
    rule = QuantRule(layers=["*.pv"], roles=["wgrad.*"], format="e4m3", scaling="tensor", rht=16)
    assert (
        resolve_plan(QuantizeConfig(rules=[rule]), layers())["layers.0.attention.pv"].spec("wgrad.input").rht
        == 16
    )
