"""Delayed scaling: the history buffer against the plain-list definition, the cast against the scalar rounding
reference, evaluation reads without recording, and a layer restored from its state_dict continues exactly."""

from __future__ import annotations

import pytest
import torch

from low_bits_training.formats import QuantSpec, fake_quantize, scale_from_amax
from low_bits_training.formats.reference import ref_round
from low_bits_training.nn import ROLE_NAMES, LinearPlan, QuantLinear
from low_bits_training.nn.cast import cast, delayed_values
from low_bits_training.nn.delayed import new_history, reference_amaxes

AMAXES = [3.0, 0.5, 8.0, float("nan"), 2.0, 0.0, float("inf"), 1.0, 1.5]


@pytest.mark.parametrize("compute", ["max", "most_recent"])
@pytest.mark.parametrize("n", [1, 3])
def test_history_follows_the_definition(n, compute):
    spec = QuantSpec("e4m3", "tensor", amax_history=n, amax_compute=compute)
    row = torch.zeros(8)
    for a, want in zip(AMAXES, reference_amaxes(AMAXES, spec), strict=True):
        t = torch.tensor([[a, -a / 2]])  # amax a
        _, scale = delayed_values(t, spec, (), None, row, record=True)
        torch.testing.assert_close(
            scale, scale_from_amax(torch.tensor([[want]]), spec), rtol=0, atol=0, equal_nan=True
        )
    assert row[n:].abs().sum() == 0  # only the role's own N entries are used


def test_cast_equals_the_scalar_reference_and_current_scaling():
    g = torch.Generator().manual_seed(0)
    t = torch.randn(16, 32, generator=g)
    spec = QuantSpec("e4m3", "tensor", amax_history=4)
    row = torch.zeros(4)
    row[1] = 2 * t.abs().max()  # a larger past amax: the current values sit lower on the grid
    q, scale = delayed_values(t, spec, (), None, row, record=False)
    s = scale.item()
    assert s == scale_from_amax(row[1].reshape(1, 1), spec).item()
    ref = torch.tensor([[ref_round(v / s, "e4m3") * s for v in r] for r in t.tolist()])
    assert torch.equal(q * scale, ref)
    # An empty history (nothing known yet) is current scaling, bit for bit.
    assert torch.equal(cast(t, spec, history=torch.zeros(4)), fake_quantize(t, spec))


def test_values_beyond_the_history_amax_saturate():
    spec = QuantSpec("e4m3", "tensor", amax_history=2)
    row = torch.tensor([1.0, 0.0])
    q = cast(torch.tensor([[0.5, 4.0]]), spec, history=row)
    assert q.tolist() == [[0.5, 1.0]]  # 4 > the history amax 1: clamped to 448 * (1 / 448)


def _layer(n: int = 4) -> QuantLinear:
    spec = QuantSpec.fp8_tensorwise(amax_history=n)
    grad = QuantSpec.fp8_tensorwise("e5m2", amax_history=n, amax_compute="most_recent")
    specs = {r: grad if "grad_output" in r else spec for r in ROLE_NAMES}
    layer = QuantLinear(32, 24, bias=False, plan=LinearPlan.from_roles(specs))
    torch.nn.init.normal_(layer.weight, generator=torch.Generator().manual_seed(1))
    return layer


def _step(layer: QuantLinear, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + i)
    x = torch.randn(8, 32, generator=g) * (1 + i)
    y = layer(x)
    y.backward(torch.randn(8, 24, generator=g))
    grad = layer.weight.grad.clone()
    layer.weight.grad = None
    return torch.cat((y.detach().flatten(), grad.flatten()))


def test_evaluation_reads_the_history_without_recording():
    layer = _layer()
    _step(layer, 0)
    before = layer.lbt_amax_history.clone()
    with torch.no_grad():
        layer(torch.randn(8, 32) * 100)
    assert torch.equal(layer.lbt_amax_history, before) and before[0, 0] > 0


def test_resume_from_state_dict_continues_exactly():
    a = _layer()
    for i in range(3):
        _step(a, i)
    b = _layer()
    b.load_state_dict(a.state_dict())  # weights and amax history: what a checkpoint holds
    assert "lbt_amax_history" in a.state_dict()
    for i in range(3, 6):
        assert torch.equal(_step(a, i), _step(b, i))
    c = _layer()  # the same weights without the history scale differently: the history is state
    c.weight.data.copy_(a.weight)
    assert not torch.equal(_step(a, 6), _step(c, 6))


def test_layers_without_delayed_roles_have_no_history():
    assert new_history((QuantSpec("e4m3"),) * 6) is None
    layer = QuantLinear(32, 16, plan=LinearPlan.from_roles(dict.fromkeys(ROLE_NAMES, QuantSpec("e4m3"))))
    assert "lbt_amax_history" not in layer.state_dict()
