"""Every recipe's QuantLinear compiles with fullgraph=True and computes what eager computes, bit for bit.

One model holds one layer per recipe of a covering set, so one compilation covers them all; the probes
(statistics and non-finite flags) and the stochastic-rounding keys run inside the graph too. The other recipes
are variants whose every operand feature (scaling, scale format, rounding, RHT, 4over6, delayed scaling, cast
source, two-level scale) appears in the covering set (asserted below), so a recipe that brings a new feature
fails that test until it joins the set; tests/nn/test_operand_options.py compiles every option value as well.
"""

import pytest
import torch
from nn_helpers import saved_bytes
from torch import nn

from low_bits_training.nn import LinearPlan, ProbeMode, QuantLinear, functional, probe, rng
from low_bits_training.nn.recipes import RECIPES

QUANTIZED = [
    "fp8_tensorwise", "fp8_rowwise", "deepseek_fp8", "int8", "fp8_delayed",
    "mxfp8", "mxfp8_2d_weights", "mxfp4", "nvfp4", "nvfp4_4over6",
]  # fmt: skip
"""The covering set compiled here (one model; compile time grows with each layer)."""


def _features(recipe: str) -> set[tuple]:
    """What a recipe's casts do, format constants left out: one tuple per quantized operand role."""
    return {
        (
            s.scaling,
            s.scale_format,
            s.rounding,
            s.rht > 0,
            s.four_over_six,
            s.amax_history > 0,
            s.source,
            s.tensor_scale,
            s.format.startswith("int"),
        )  # fmt: skip
        for s in RECIPES[recipe].values()
        if s is not None
    }


def test_the_compiled_recipes_cover_every_recipe_feature():
    covered = set().union(*(_features(r) for r in QUANTIZED))
    for r in RECIPES:
        assert _features(r) <= covered, f"recipe {r} uses {_features(r) - covered}: add it to QUANTIZED"


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = []
    for i, r in enumerate(QUANTIZED):
        q = QuantLinear(256, 256, bias=False, plan=LinearPlan.from_roles(RECIPES[r]))
        q.set_name(f"layers.{i}.{r}")
        layers.append(q)
    return nn.Sequential(*layers)


def _step(model, x, run=None):
    xg = x.clone().requires_grad_()
    y = (run or model)(xg)
    y.square().mean().backward()
    grads = [m.weight.grad.clone() for m in model]
    model.zero_grad()
    return [y.detach(), xg.grad, *grads], torch.stack([m.lbt_stats.clone() for m in model])


def test_every_recipe_compiles_fullgraph_and_equals_eager():
    assert "nvfp4" in QUANTIZED and any(
        s is not None and s.rounding == "stochastic" for r in QUANTIZED for s in RECIPES[r].values()
    )  # stochastic rounding is covered
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    eager, comp = _model(), _model()
    compiled = torch.compile(comp, fullgraph=True)
    try:
        probe.set_mode(ProbeMode(stats=True, nonfinite=True))
        for step in (1, 2):
            rng.set_step_key(step)
            for m in (*eager, *comp):
                probe.reset(m.state)
            (got, got_stats), (want, want_stats) = _step(comp, x, compiled), _step(eager, x)
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                assert torch.equal(g, w), f"step {step}, tensor {i}"
            # counts and extrema are exact; energies are float64 sums whose order inductor may change
            torch.testing.assert_close(got_stats, want_stats, rtol=1e-9, atol=0)
    finally:
        probe.set_mode(ProbeMode())
        rng.set_step_key(None)
    assert not any(m.lbt_flags.any() for m in comp)
    assert all(m.lbt_stats[0, 0] == 256 * 256 for m in comp)  # forward.input seen once per step


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "nvfp4", "int8"])
def test_compiled_backward_keeps_the_weight_not_its_cast(recipe, monkeypatch):
    """The forward and dgrad casts of W share their ops (all of them for fp8_tensorwise's and NVFP4's equal
    specs, the fp32 upcast for int8's rowwise casts along different dims); compiled, the partitioner kept the
    merged fp32 tensor from forward to backward instead of W (``functional.recast_under_compile``). A layer
    whose output feeds a SiLU is the pattern where it did (every MLP's w1 / w3). Casting W again gives the
    same results as keeping its cast."""
    assert functional.recast_under_compile(LinearPlan.from_recipe(recipe))
    torch.manual_seed(0)
    x = torch.randn(128, 64, dtype=torch.bfloat16, requires_grad=True)
    q = QuantLinear(64, 96, bias=False, plan=LinearPlan.from_recipe(recipe)).to(torch.bfloat16)
    q.set_name("layers.0.w1")  # stochastic rounding's key

    def block(x):
        return nn.functional.silu(q(x))

    def run(recast: bool):
        torch._dynamo.reset()
        monkeypatch.setattr(functional, "recast_under_compile", lambda plan: recast)
        rng.set_step_key(1)
        try:
            saved = saved_bytes(torch.compile(block, fullgraph=True), x)
        finally:
            rng.set_step_key(None)
        grads = (x.grad, q.weight.grad)
        x.grad = q.weight.grad = None
        return saved, grads

    _, kept = run(recast=False)
    saved, recast = run(recast=True)
    assert ((96, 64), torch.float32) not in saved, saved
    assert saved.get(((96, 64), torch.bfloat16)) == 96 * 64 * 2  # W itself
    assert all(torch.equal(a, b) for a, b in zip(kept, recast, strict=True))
