"""The ``nvfp4_te`` recipe (issue 38): NVFP4 as Transformer Engine's NVFP4BlockScaling computes it.

Each role's resolved spec carries TE's options; a layer under the recipe equals, bit for bit, the TE oracle
(``formats_helpers.te_reference``, written from TE's algorithm in numpy) applied role by role (forward,
dgrad, and wgrad after the RHT with TE's sign vector), eager and compiled; the stochastically rounded
gradient casts land on one of the two e2m1 neighbours of TE's scaled value under TE's block scales."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from formats_helpers import F32, te_reference, te_scaled

from low_bits_training.config.quantize import QuantizeConfig, QuantRule
from low_bits_training.formats.hadamard import rht, sign_vector
from low_bits_training.nn import LinearPlan, QuantLinear, rng
from low_bits_training.nn.cast import cast
from low_bits_training.nn.recipes import RECIPES, recipe_specs
from low_bits_training.plan.resolve import LayerShape, resolve_plan

SHAPE = {"l": LayerShape(256, 256, 128)}
TE_OPTIONS = dict(scale_apply="reciprocal", scale_underflow="zero", scale_order="te")
OURS = dict(scale_apply="divide", scale_underflow="clamp", scale_order="decode", rht_signs="seeded")
TE_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)  # TE's get_wgrad_sign_vector()
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], F32)


def _resolved(rules=()) -> LinearPlan:
    return resolve_plan(QuantizeConfig(recipe="nvfp4_te", skip=[], rules=list(rules)), SHAPE)["l"]


def test_every_role_has_te_options():
    plan = _resolved()
    for role, want in {
        # role: (scaling, rounding, rht, contraction axis)
        "forward.input": ("block", "nearest", 0, -1),
        "forward.weight": ("tile", "nearest", 0, -1),
        "dgrad.grad_output": ("block", "stochastic", 0, -1),
        "dgrad.weight": ("tile", "nearest", 0, -1),
        "wgrad.grad_output": ("block", "stochastic", 16, 0),
        "wgrad.input": ("block", "nearest", 16, 0),
    }.items():
        s = plan.spec(role)
        assert (s.format, s.block_size, s.scale_format, s.tensor_scale) == ("e2m1", 16, "ue4m3", True), role
        assert (s.scaling, s.rounding, s.rht, s.axis) == want, role
        assert {k: getattr(s, k) for k in TE_OPTIONS} == TE_OPTIONS, role
        assert s.rht_signs == ("te" if s.rht else "seeded"), role
        assert s.source == "high" and s.four_over_six == "off" and s.scale_rounding == "exact", role
    # ... and nvfp4 is the same recipe with our conventions (its own specs untouched: the defaults).
    assert {r: dataclasses.replace(s, **OURS) for r, s in RECIPES["nvfp4_te"].items()} == RECIPES["nvfp4"]
    assert all(s.scale_order == "decode" and s.scale_apply == "divide" for s in RECIPES["nvfp4"].values())
    assert sign_vector(16, 0, RECIPES["nvfp4_te"]["wgrad.input"].rht_signs) == TE_SIGNS


def test_rules_compose_with_the_recipe():
    # A rule changing one field keeps TE's options on the roles it touches and leaves the others alone.
    plan = _resolved([QuantRule(roles=["*.grad_output"], rounding="nearest")])
    assert plan.spec("wgrad.grad_output").rounding == "nearest"
    assert plan.spec("wgrad.grad_output").scale_order == "te" and plan.spec("wgrad.grad_output").rht == 16
    assert plan.spec("forward.input") == _resolved().spec("forward.input")
    assert LinearPlan.from_recipe("nvfp4_te") == _resolved()


def _te(t: torch.Tensor, tile: int = 1, axis: int = -1) -> torch.Tensor:
    """TE's dequantized cast of a 2-D fp32 operand, 1 x 16 blocks (or 16 x 16 tiles) along ``axis``."""
    a = t.detach().numpy() if axis == -1 else t.detach().t().contiguous().numpy()
    d = torch.from_numpy(te_reference(a, tile)[2])
    return d if axis == -1 else d.t()


def _operands():
    """x (64, 128), w (96, 128), dy (64, 96): outlier channels, and test_scale_order's element tie in x
    (tensor amax 10, 1.25 beside it: 1.0 in our order, 0.5 in TE's)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 128, generator=g) * (1 + 4 * (torch.rand(128, generator=g) > 0.9))).clamp(-9, 9)
    x[0, 0], x[0, 1] = 10.0, 1.25
    w = torch.randn(96, 128, generator=g) / 11
    return x, w, torch.randn(64, 96, generator=g) * 1e-3


def _grads(layer, x, dy):
    xg = x.clone().requires_grad_()
    y = layer(xg)
    y.backward(dy)
    out = (y.detach(), xg.grad, layer.weight.grad.clone())
    layer.weight.grad = None
    return out


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_layer_equals_the_te_oracle_role_by_role(compiled):
    # The gradients rounded to nearest here (SR draws are held in the next test): every GEMM is then the
    # product of TE's casts, the wgrad operands after the RHT with TE's signs along the tokens.
    specs = {r: dataclasses.replace(s, rounding="nearest") for r, s in recipe_specs("nvfp4_te").items()}
    x, w, dy = _operands()
    layer = QuantLinear(128, 96, bias=False, plan=LinearPlan.from_roles(specs))
    layer.weight.data.copy_(w)
    fn = torch.compile(layer, fullgraph=True) if compiled else layer
    y, dx, dw = _grads(fn, x, dy)
    s = TE_SIGNS
    assert torch.equal(y, _te(x) @ _te(w, 16).t())
    assert torch.equal(dx, _te(dy) @ _te(w, 16))
    assert torch.equal(dw, _te(rht(dy, s, 0), 1, 0).t() @ _te(rht(x, s, 0), 1, 0))
    # The same layer under nvfp4 (rounded to nearest) does not: the ties of x, the wgrad signs.
    ours = {r: dataclasses.replace(s, rounding="nearest") for r, s in recipe_specs("nvfp4").items()}
    layer = QuantLinear(128, 96, bias=False, plan=LinearPlan.from_roles(ours))
    layer.weight.data.copy_(w)
    y2, _, dw2 = _grads(layer, x, dy)
    assert not torch.equal(y2, y) and not torch.equal(dw2, dw)


def _neighbours(t: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TE's dequantized e2m1 neighbours (toward zero, away from zero) of each value and its RNE cast."""
    a = t.numpy() if axis == -1 else t.t().contiguous().numpy()
    v, block, ts = te_scaled(a)
    i = np.clip(np.searchsorted(E2M1, np.abs(v), side="right") - 1, 0, 7)
    lo, hi = E2M1[i], np.where(E2M1[i] == np.abs(v), E2M1[i], E2M1[np.minimum(i + 1, 7)])
    deq = [((np.copysign(c, v) * block).astype(F32) * ts).astype(F32).reshape(a.shape) for c in (lo, hi)]
    out = [torch.from_numpy(d) for d in (*deq, te_reference(a)[2])]
    return tuple(d if axis == -1 else d.t() for d in out)


@pytest.mark.parametrize("role", ["dgrad.grad_output", "wgrad.grad_output"])
def test_stochastic_gradients_land_on_a_te_neighbour(role):
    spec = LinearPlan.from_recipe("nvfp4_te").spec(role)
    axis = -1 if spec.axis in (-1, 1) else 0
    dy = (torch.randn(64, 96, generator=torch.Generator().manual_seed(3)) * 1e-3).clamp(-2.8e-3, 2.8e-3)
    # test_scale_order's block-scale tie, scaled by 2**-10: tensor amax 3, a block of amax 9/1024 (its e4m3
    # scale 1.25 in our order, 1.375 in TE's), in dgrad's 1x16 blocks along the rows
    dy[0, 0], dy[1, :16] = 3 * 2.0**-10, 0.0
    dy[1, 0] = 9 * 2.0**-20
    t = rht(dy, TE_SIGNS, 0) if spec.rht else dy
    lo, hi, nearest = _neighbours(t, axis)
    compiled = torch.compile(lambda u: cast(u, spec), fullgraph=True)
    for got in (cast(t, spec), compiled(t)):
        assert bool(((got == lo) | (got == hi)).all()), role
        assert 0.2 < (got != nearest).float().mean() < 0.5, role  # stochastic: a third away from nearest
    mean = torch.stack([cast(t, spec) for _ in range(64)]).mean(0)
    assert (mean - t).abs().mean() < 0.3 * (nearest - t).abs().mean(), role  # unbiased on average
    if not spec.rht:  # our order's block scale 1.25 puts the tie's value off TE's neighbours
        ours = cast(t, dataclasses.replace(spec, **OURS))
        assert ours[1, 0] not in (lo[1, 0], hi[1, 0]), role


def test_compiled_equals_eager_with_stochastic_gradients():
    x, w, dy = _operands()
    runs = []
    for compiled in (False, True):
        layer = QuantLinear(128, 96, bias=False, plan=LinearPlan.from_recipe("nvfp4_te"))
        layer.weight.data.copy_(w)
        layer.set_name("layers.0.mlp")
        fn = torch.compile(layer, fullgraph=True) if compiled else layer
        rng.set_step_key(7)
        runs.append(_grads(fn, x, dy))
    rng.set_step_key(None)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)
