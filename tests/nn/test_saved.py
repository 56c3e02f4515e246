"""Low-bit saved activations (nn/saved.py, config/saved.py): what the backward reads is the decoded save."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from low_bits_training.config.saved import SavedRule, resolve_saved, rule_format
from low_bits_training.errors import ConfigError
from low_bits_training.formats import QuantSpec, fake_quantize
from low_bits_training.nn import saved

E4M3 = QuantSpec("e4m3", "tensor")


class MLP(torch.nn.Module):
    def __init__(self, d: int = 64, h: int = 128):
        super().__init__()
        self.w1 = torch.nn.Linear(d, h, bias=False)
        self.w3 = torch.nn.Linear(d, h, bias=False)
        self.w2 = torch.nn.Linear(h, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def _grads(model, x):
    model.zero_grad()
    x = x.detach().requires_grad_(True)
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def _reference(model, x, spec):
    """The backward of the MLP by hand, every saved activation (not the input leaf) fake-quantized."""
    q = lambda t: fake_quantize(t, spec)  # noqa: E731
    w1, w3, w2 = model.w1.weight, model.w3.weight, model.w2.weight
    a, b = x @ w1.T, x @ w3.T
    s = F.silu(a)
    m = s * b
    y = m @ w2.T
    g = 2 * y
    gw2 = g.T @ q(m)
    gm = g @ w2
    qa = q(a)
    sig = torch.sigmoid(qa)
    ga = gm * q(b) * (sig * (1 + qa * (1 - sig)))
    gb = gm * q(s)
    gx = ga @ w1 + gb @ w3
    return [ga.T @ x, gb.T @ x, gw2, gx]  # x: a leaf that requires grad, kept as it is


def test_the_backward_reads_the_decoded_saves_and_parameters_are_left_alone():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(32, 64) * 3
    saved.install(model, "mlp", saved.SaveFormat(saved.ReferenceCodec(E4M3), min_numel=0))
    got = _grads(model, x)
    want = _reference(model, x, E4M3)
    order = [model.w1.weight, model.w3.weight, model.w2.weight]
    for g, w in zip(got, [*want[:3], want[3]], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert [p.grad is not None for p in order] == [True] * 3
    plain = MLP()
    plain.load_state_dict(model.state_dict())
    exact = _grads(plain, x)
    assert any((a - b).abs().max() > 1e-4 for a, b in zip(got, exact, strict=True))  # the saves were rounded


def test_bytes_are_counted_once_per_tensor_and_codes_are_one_byte():
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(32, 64, requires_grad=True)
    saved.install(model, "mlp", saved.SaveFormat(saved.ReferenceCodec(E4M3), min_numel=0))
    saved.take_bytes()
    (model(x.detach().clone()) * 1.0).sum().backward()  # x needs no grad: an activation
    counts = saved.take_bytes()["mlp"]
    # x (once, though w1 and w3 both save it), w1 x, w3 x, silu(w1 x), the product: 32 x (64 + 4 x 128)
    numel = 32 * (64 + 4 * 128)
    assert counts[0] == numel and counts[1] == 4 * numel
    assert counts[2] == numel + 4 * 5  # one e4m3 code per element, one fp32 scale per tensor


def test_a_leaf_input_that_requires_grad_is_kept_as_it_is():
    model, x = MLP(), torch.randn(32, 64, requires_grad=True)
    saved.install(model, "mlp", saved.SaveFormat(saved.ReferenceCodec(E4M3), min_numel=0))
    saved.take_bytes()
    model(x).sum().backward()
    counts = saved.take_bytes()["mlp"]
    assert counts[0] == 32 * 4 * 128 and counts[2] == 32 * 4 * 128 + 4 * 4  # x is not counted


def test_bf16_cast_and_small_tensors():
    model, x = MLP(), torch.randn(32, 64)
    saved.install(model, "mlp", saved.SaveFormat(saved.ReferenceCodec(cast="bf16"), min_numel=32 * 100))
    saved.take_bytes()
    model(x).sum().backward()
    counts = saved.take_bytes()["mlp"]
    assert counts[2] == 32 * 64 * 4 + 4 * 32 * 128 * 2  # x (2,048 elements < min_numel) kept fp32


@pytest.mark.parametrize("fmt", ["e4m3", "int8", "e2m1"])
def test_compiled_module_saves_through_the_hooks(fmt):
    """torch.compile of the module (fullgraph, as torchtitan compiles a block): the hooks sit outside and see
    what the compiled graph saves; 'high' hooks leave it bit for bit."""
    torch.manual_seed(1)
    x = torch.randn(32, 64)
    ref = MLP()
    ref.compile(fullgraph=True)
    want = _grads(ref, x)
    high = MLP()
    high.load_state_dict(ref.state_dict())
    high.compile(fullgraph=True)
    saved.install(high, "mlp", saved.SaveFormat())
    assert all(torch.equal(a, b) for a, b in zip(_grads(high, x), want, strict=True))
    low = MLP()
    low.load_state_dict(ref.state_dict())
    low.compile(fullgraph=True)
    spec = QuantSpec(fmt, "block", block_size=32)
    saved.install(low, "mlp", saved.SaveFormat(saved.ReferenceCodec(spec), min_numel=0))
    saved.take_bytes()
    got = _grads(low, x)
    made, kept = saved.take_bytes()["mlp"][1:]
    bits = spec.elem.bits
    assert kept == made / 4 * bits / 8 + made / 4 / 32 * 4  # codes, one fp32 scale per 32
    err = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, want, strict=True))
    assert 0 < err < {"e4m3": 0.05, "int8": 0.02, "e2m1": 0.3}[fmt]


def test_rules_resolve_last_one_wins_and_high_undoes():
    mods = ["", "layers", "layers.0", "layers.0.attention", "layers.0.feed_forward", "layers.1", "norm"]
    rules = [
        SavedRule(modules=["layers.*"], format="e4m3"),
        SavedRule(modules=["layers.1"], format="bf16"),
        SavedRule(modules=["layers.0.attention"], format="high"),
    ]
    got = resolve_saved(rules, mods, False, {})
    assert {m: f.label for m, f in got.items()} == {  # layers.* selects the blocks, not their parts
        "layers.0": "e4m3/axis-1(fp32,exact)/rne",
        "layers.0.attention": "high",
        "layers.1": "bf16",
    }


@pytest.mark.parametrize(
    ("rule", "compiled", "message"),
    [
        (SavedRule(modules=["blocks.*"]), False, "quantize.saved[0].modules: 'blocks.*' matches no module"),
        (SavedRule(modules=["layers.*.feed_forward"]), True, "'layers.0.feed_forward', which is not a whole"),
        (
            SavedRule(modules=["layers.0"], scaling="block", block_size=48),
            False,
            "quantize.saved[0].block_size = 48: 'layers.0' saves tensors whose last dim is 64",
        ),
        (
            SavedRule(format="fp32"),
            False,
            "quantize.saved[0].format = 'fp32': a save is held in codes of <= 8",
        ),
        (SavedRule(format="e9m9"), False, "quantize.saved[0]"),
    ],
)
def test_bad_rules_are_one_line(rule, compiled, message):
    mods = ["", "layers", "layers.0", "layers.0.feed_forward"]
    with pytest.raises(ConfigError) as e:
        resolve_saved([rule], mods, compiled, {"layers.0": {64, 256}, "layers.0.feed_forward": {64, 256}})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_rule_fields_are_checked_when_built():
    with pytest.raises(ConfigError, match=r"quantize.saved.rounding = 'stochastic'"):
        SavedRule(rounding="stochastic")
    assert rule_format(SavedRule(format="bf16"), "q").cast == "bf16"
