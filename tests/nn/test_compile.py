"""Every recipe's QuantLinear compiles with fullgraph=True and computes what eager computes, bit for bit.

One model holds one layer per recipe, so one compilation covers them all; the probes (statistics and
non-finite flags) and the stochastic-rounding keys run inside the graph too.
"""

import pytest
import torch
from torch import nn

from low_bits_training.config.recipes import RECIPES
from low_bits_training.nn import LinearPlan, ProbeMode, QuantLinear, probe, rng

QUANTIZED = [r for r in RECIPES if r != "bf16"]


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


@pytest.mark.slow
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
