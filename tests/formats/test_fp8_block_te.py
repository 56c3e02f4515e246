"""Blockwise fp8 as Transformer Engine's ``Float8BlockQuantizer`` computes it (issue 38): recipes
``fp8_block_te`` (TE's default power-of-two scales) and ``fp8_block_te_exact`` (its fp32 scales,
``scale_order = "te"`` on one level).

``te_block`` is TE's scale rule written from its pure-PyTorch reference (``scale_from_amax_tensor``: e =
fl(448 / amax), inf -> fp32 max, power of two by frexp, a zero amax gives 1, the stored scale fl(1 / e)) and
its cast (values times e, rounded to e4m3 by torch's cast). TE does not run here (no CUDA, not installed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from low_bits_training.formats import QuantSpec, fake_quantize
from low_bits_training.formats.scaling import compute_scales
from low_bits_training.nn import LinearPlan, QuantLinear
from low_bits_training.nn.recipes import RECIPES, recipe_specs

EXACT = QuantSpec.deepseek_act(scale_apply="reciprocal", scale_order="te")
POW2 = QuantSpec.deepseek_act(scale_rounding="rceil")
FP32_MAX = torch.finfo(torch.float32).max


def te_encode(amax: torch.Tensor, pow2: bool, top: float = 448.0) -> torch.Tensor:
    """TE's quantization scale per block amax (fp32)."""
    e = torch.div(torch.full_like(amax, top), amax)
    e = torch.where(e == torch.inf, FP32_MAX, e)
    if pow2:
        _, ex = torch.frexp(e)
        e = torch.ldexp(torch.ones_like(e), ex - 1)
    return torch.where(amax == 0, 1.0, e)


def te_block(x: torch.Tensor, tile: int = 1, pow2: bool = False) -> torch.Tensor:
    """TE's dequantized cast of a 2-D tensor: 1 x 128 blocks along the rows (or 128 x 128 tiles)."""
    m, n = x.shape
    g = x.float().reshape(m // tile, tile, n // 128, 128)
    e = te_encode(g.abs().amax(dim=(1, 3), keepdim=True), pow2)
    q = (g * e).to(torch.float8_e4m3fn).float()
    return (q * torch.reciprocal(e)).reshape(m, n)


def _binade() -> torch.Tensor:
    """Every fp32 amax in [1, 2) (the rules are periodic in the binade away from the ends of fp32)."""
    return (torch.arange(0, 2**23, dtype=torch.int32) | (127 << 23)).view(torch.float32)


def test_recipes_roles():
    for name, rounding, order in (("fp8_block_te", "rceil", "decode"), ("fp8_block_te_exact", "exact", "te")):
        specs = recipe_specs(name)
        for role, s in specs.items():
            tile = role.endswith("weight")
            assert (s.format, s.scaling, s.block_size, s.scale_format) == (
                "e4m3",
                "tile" if tile else "block",
                128,
                "fp32",
            ), (name, role)
            assert (s.scale_rounding, s.scale_order, s.rounding) == (rounding, order, "nearest"), (name, role)
    ours = {
        r: dataclasses.replace(s, scale_apply="divide", scale_order="decode")
        for r, s in RECIPES["fp8_block_te_exact"].items()
    }
    assert ours == RECIPES["deepseek_fp8"]
    assert "teorder" in str(LinearPlan.from_recipe("fp8_block_te_exact").spec("forward.input"))


@pytest.mark.parametrize("fmt, top", [("e4m3", 448.0), ("e5m2", 57344.0)])
def test_scales_over_a_binade(fmt, top):
    # One block per amax (a block of one value: the rule does not depend on the block's size).
    amax = _binade()
    x = amax.reshape(-1, 1)
    one = dict(block_size=1, format=fmt)
    exact = compute_scales(x, dataclasses.replace(EXACT, **one)).flatten()
    assert torch.equal(exact, torch.reciprocal(te_encode(amax, False, top)))
    ours = compute_scales(x, dataclasses.replace(QuantSpec.deepseek_act(fmt), **one)).flatten()
    assert 0.25 < (ours != exact).float().mean() < 0.30  # one ulp apart for about 27% of amaxes
    assert (((ours.view(torch.int32) - exact.view(torch.int32)).abs()) <= 1).all()
    # TE's power-of-two scales are our rceil for every amax
    assert torch.equal(
        compute_scales(x, dataclasses.replace(POW2, **one)).flatten(), 1 / te_encode(amax, True, top)
    )


def test_hand_computed_block():
    # A block of amax 11: TE multiplies by fl(448 / 11) = 40.727272... and stores fl(1 / fl(448 / 11)) =
    # 0.02455357275903225, one ulp above our fl(11 / 448) = 0.0245535708963871; 11 becomes 448 either way, so
    # it dequantizes to fl(448 x 0.02455357275903225) = 11.000001 under TE's rule, to 11 under ours.
    x = torch.zeros(1, 256)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 11.0, -1.5, -0.0, 2.0**-20
    x[0, 128] = -0.0  # second block: all zero but a -0
    assert compute_scales(x, EXACT)[0, 0, 0].item() == 0.02455357275903225
    assert compute_scales(x, QuantSpec.deepseek_act())[0, 0, 0].item() == 0.0245535708963871
    got = fake_quantize(x, EXACT)
    assert got[0, 0].item() == (torch.tensor(448.0) * torch.tensor(0.02455357275903225)).item() != 11.0
    assert fake_quantize(x, QuantSpec.deepseek_act())[0, 0].item() == 11.0
    assert torch.equal(got, te_block(x))
    assert torch.signbit(got[0, 2]) and torch.signbit(got[0, 128])  # -0 kept (TE's torch cast keeps it)
    assert compute_scales(x, EXACT)[0, 1, 0].item() == 1.0  # a zero block: scale 1
    # power of two: 448 / 11 = 40.7 -> 32, stored 1/32; 11 -> 352 and -1.5 -> -48 exactly
    p = fake_quantize(x, POW2)
    assert (p[0, 0].item(), p[0, 1].item(), compute_scales(x, POW2)[0, 0, 0].item()) == (11.0, -1.5, 1 / 32)
    assert torch.equal(p, te_block(x, pow2=True))


def _data(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(128, 256, generator=g) * (1 + 20 * (torch.rand(256, generator=g) > 0.95))
    x[3, :128] = 0.0
    x[4, 128:] = -0.0
    x[5, :128] *= 1e-30
    x[6] = torch.tensor([0.5, 1.0625, 1.125, 448.0 * 1.0625 / 64, -3.25, 0.0] * 42 + [7.0] * 4)
    return x


@pytest.mark.parametrize("pow2", [False, True], ids=["exact", "pow2"])
@pytest.mark.parametrize("tile", [1, 128])
def test_cast_equals_te(tile, pow2):
    base = POW2 if pow2 else EXACT
    spec = (
        QuantSpec(
            "e4m3",
            "tile",
            block_size=128,
            **{k: getattr(base, k) for k in ("scale_rounding", "scale_apply", "scale_order")},
        )
        if tile > 1
        else base
    )
    for seed in range(3):
        for scale in (1.0, 1e-3, 1e4):
            x = _data(seed) * scale
            got, want = fake_quantize(x, spec), te_block(x, tile, pow2)
            assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want)), (
                seed,
                scale,
            )


def test_a_layer_equals_te_role_by_role():
    g = torch.Generator().manual_seed(9)
    x, w, dy = _data(1), torch.randn(128, 256, generator=g) / 16, torch.randn(128, 128, generator=g) * 1e-3
    for name, pow2 in (("fp8_block_te_exact", False), ("fp8_block_te", True)):
        layer = QuantLinear(256, 128, bias=False, plan=LinearPlan.from_recipe(name))
        layer.weight.data.copy_(w)
        xg = x.clone().requires_grad_()
        y = layer(xg)
        y.backward(dy)
        wq = te_block(w, 128, pow2)
        assert torch.equal(y, te_block(x, 1, pow2) @ wq.t()), name
        assert torch.equal(xg.grad, te_block(dy, 1, pow2) @ wq), name
        assert torch.equal(layer.weight.grad, te_block(dy.t(), 1, pow2) @ te_block(x.t(), 1, pow2).t()), name
