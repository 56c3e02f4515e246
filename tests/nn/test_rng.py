"""Stochastic rounding in layers: counter-based keys from (step key, layer key, role), not the global RNG."""

import pytest
import torch

from low_bits_training.formats import QuantSpec
from low_bits_training.nn import ROLE_NAMES, LinearPlan, QuantLinear, rng

SR = QuantSpec(
    "e4m3", "block", block_size=32, scale_format="e8m0", scale_rounding="floor", rounding="stochastic"
)


def _layer(name: str = "layers.0.wq") -> QuantLinear:
    torch.manual_seed(0)
    q = QuantLinear(64, 64, bias=False, plan=LinearPlan.from_roles(dict.fromkeys(ROLE_NAMES, SR)))
    q.set_name(name)
    return q


def _grads(layer: QuantLinear, x: torch.Tensor):
    xg = x.clone().requires_grad_()
    y = layer(xg)
    y.backward(torch.ones_like(y) * 1e-3)
    g = layer.weight.grad.clone()
    layer.weight.grad = None
    return y.detach(), xg.grad, g


@pytest.fixture
def x():
    return torch.randn(32, 64, generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def _clear_step_key():
    yield
    rng.set_step_key(None)


def test_same_step_key_same_bits_whatever_else_draws(x):
    layer = _layer()
    rng.set_step_key(123)
    a = _grads(layer, x)
    torch.rand(1000)  # e.g. a lazy first-step initialisation drawing from the global RNG
    b = _grads(layer, x)
    rng.set_step_key(124)
    c = _grads(layer, x)
    for t_a, t_b, t_c in zip(a, b, c, strict=True):
        assert torch.equal(t_a, t_b)
        assert not torch.equal(t_a, t_c)  # another step, other draws


def test_layers_and_roles_draw_different_bits():
    rng.set_step_key(5)
    k0, k1 = _layer("layers.0.wq").lbt_key, _layer("layers.1.wq").lbt_key
    keys = {int(rng.role_key(k, r)) for k in (k0, k1) for r in range(len(ROLE_NAMES))}
    assert len(keys) == 2 * len(ROLE_NAMES)


def test_without_a_step_key_the_global_rng_is_used(x):
    layer = _layer()
    torch.manual_seed(7)
    a = _grads(layer, x)
    torch.manual_seed(7)
    b = _grads(layer, x)
    c = _grads(layer, x)
    assert torch.equal(a[2], b[2]) and not torch.equal(b[2], c[2])


def test_compiled_layer_rounds_like_eager_bit_for_bit(x):
    eager, comp = _layer(), _layer()
    compiled = torch.compile(comp, fullgraph=True)
    for step in (1, 2):  # a new step key is read at run time: no recompile, other bits
        rng.set_step_key(step)
        for t_e, t_c in zip(_grads(eager, x), _grads(compiled, x), strict=True):
            assert torch.equal(t_e, t_c)
