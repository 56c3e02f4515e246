"""Issue 13's operand options against a layer's shape and placement (plan/options.py), through
``resolve_plan`` as the launcher calls it: one line naming the key, the layer, the role and the number."""

import pytest

from low_bits_training.config.quantize import QuantizeConfig, QuantRule
from low_bits_training.errors import ConfigError
from low_bits_training.plan.resolve import LayerShape, resolve_plan


def _plan(rule: QuantRule, shape: LayerShape, recipe: str = "nvfp4"):
    return resolve_plan(QuantizeConfig(recipe=recipe, skip=[], rules=[rule]), {"layers.0.w": shape})


def test_nvfp4_rht16_fits_the_debug_shapes_on_two_tp_ranks():
    plans = _plan(QuantRule(roles=["wgrad.*"], rht=16), LayerShape(256, 768, 128, tp=2))
    assert plans["layers.0.w"].spec("wgrad.input").rht == 16


@pytest.mark.parametrize(
    ("rule", "shape", "message"),
    [
        (  # wgrad contracts over tokens: a multiple of seq_len 48, which 32 does not divide
            QuantRule(roles=["wgrad.*"], rht=32),
            LayerShape(256, 256, 48),
            "quantize: layers.0.w wgrad.grad_output: rht = 32 does not divide the wgrad GEMM's contraction dim "
            "(tokens: seq_len 48)",
        ),
        (  # forward contracts over K = 96: whole it fits 32, a 1/2 shard (48) does not... but 16 does
            QuantRule(roles=["forward.*"], rht=32),
            LayerShape(96, 256, 128, tp=2),
            "quantize: layers.0.w forward.input: rht = 32 does not divide the forward GEMM's contraction dim "
            "(in_features 96, 48 per TP shard)",
        ),
        (
            QuantRule(roles=["dgrad.*"], rht=64),
            LayerShape(256, 96, 128),
            "quantize: layers.0.w dgrad.grad_output: rht = 64 does not divide the dgrad GEMM's contraction dim "
            "(out_features 96)",
        ),
    ],
    ids=["wgrad-tokens", "forward-tp-shard", "dgrad"],
)
def test_rht_that_does_not_divide_the_contraction_dim_is_one_line(rule, shape, message):
    with pytest.raises(ConfigError) as e:
        _plan(rule, shape)
    assert str(e.value) == message


def test_rht_on_one_operand_of_a_gemm_only_is_refused():
    with pytest.raises(
        ConfigError, match=r"layers\.0\.w wgrad: the RHT \(rht, rht_seed, rht_signs\) of its operands differ"
    ) as e:
        _plan(QuantRule(roles=["wgrad.input"], rht=32), LayerShape(256, 256, 128))
    assert "\n" not in str(e.value)


def test_te_rht_signs_reach_both_wgrad_operands_and_change_the_weight_gradient():
    # issue 38: rht_signs = "te" (Transformer Engine's fixed vector) through a rule, as a TOML would give it.
    import torch

    from low_bits_training.nn import QuantLinear

    te = _plan(QuantRule(roles=["wgrad.*"], rht_signs="te"), LayerShape(256, 256, 128))["layers.0.w"]
    seeded = _plan(QuantRule(roles=["wgrad.*"], rht=16), LayerShape(256, 256, 128))["layers.0.w"]
    assert [te.spec(r).rht_signs for r in ("wgrad.input", "wgrad.grad_output")] == ["te", "te"]
    assert te.spec("forward.input").rht_signs == "seeded"
    g = torch.Generator().manual_seed(0)
    x, w, dy = (
        torch.randn(128, 256, generator=g),
        torch.randn(256, 256, generator=g),
        torch.randn(128, 256, generator=g),
    )
    grads = []
    for plan in (te, seeded):
        layer = QuantLinear(256, 256, bias=False, plan=plan)
        layer.weight.data.copy_(w)
        layer(x).backward(dy)
        grads.append(layer.weight.grad)
    exact = dy.T @ x
    err = [((gw - exact).norm() / exact.norm()).item() for gw in grads]
    assert not torch.equal(grads[0], grads[1])  # other signs, other bits
    assert max(err) < 0.2 and abs(err[0] - err[1]) < 0.05  # both an NVFP4 wgrad of the same quality


def test_te_rht_signs_on_another_size_are_one_line():
    with pytest.raises(ConfigError) as e:
        _plan(QuantRule(roles=["wgrad.*"], rht=32, rht_signs="te"), LayerShape(256, 256, 128))
    assert "rht_signs='te' is a 16-long vector; it needs rht = 16, got 32" in str(e.value)
    assert "\n" not in str(e.value) and "quantize.rules[0]" in str(e.value)
