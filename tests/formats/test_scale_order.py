"""``QuantSpec.scale_order``: the fp32 arithmetic of two-level (NVFP4) scales, ours ("decode") or Transformer
Engine's ("te", its NVFP4 quantizer: encode scale e = fl(2688 / amax), block scale round(fl(amax_b x fl(e x
fl(1 / 6)))), values times fl(1 / fl(block x fl(1 / e))), a 0 after the multiply coded +0), issue 38.

Hand-computed cases where the two give different bits, on every cast path, eager and compiled; an oracle
written from TE's published algorithm with ml_dtypes' casts; the edge cases (zero, tiny, inf, NaN tensors)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from formats_helpers import F32, te_reference

from low_bits_training.config.quantize import QuantizeConfig, QuantRule
from low_bits_training.errors import ConfigError
from low_bits_training.formats import QuantSpec, dequantize, fake_quantize, in_scale_units, quantize, unpack
from low_bits_training.nn.cast import cast
from low_bits_training.nn.group_cast import group_cast
from low_bits_training.plan.resolve import LayerShape, resolve_plan

TE = QuantSpec.nvfp4(scale_apply="reciprocal", scale_order="te")
RECIP = QuantSpec.nvfp4(scale_apply="reciprocal")
DECODE = QuantSpec.nvfp4()
TILE_TE = QuantSpec(
    "e2m1", "tile", block_size=16, scale_format="ue4m3", tensor_scale=True, scale_apply="reciprocal",
    scale_order="te",
)  # fmt: skip


def codes(x: torch.Tensor, spec: QuantSpec) -> list[int]:
    """The e2m1 codes (sign bit 8) of ``quantize(x, spec)``, row-major."""
    q = quantize(x, spec)
    return unpack(q.codes, 4, x.numel()).tolist()


def block_scale_tie() -> torch.Tensor:
    # Tensor amax 3: our tensor scale fl(3 / 2688) = fl(1 / 896) = 9586981 x 2**-33, a hair above 1/896; TE's
    # encode scale fl(2688 / 3) = 896 exactly, and 896 x fl(1 / 6) rounds to 4893355 x 2**-15 = 149.33334351
    # (896 / 6 = 149.3333...). The block of amax 9/1024 has the exact scale 9/1024 x 896 / 6 = 1.3125, the
    # e4m3 tie of 1.25 and 1.375. Ours: fl(9/1024 / 6) = 3/2048 exactly, over the tensor scale:
    # 1.3125 (1 - 4.5e-8) -> fp32 1.3125 (5.9e-8 below, under half an ulp): the tie, to even, 1.25.
    # TE: 9/1024 x 149.33334351 = 1.3125000894 -> fp32 1.3125 + 2**-23: above the tie, 1.375.
    x = torch.zeros(2, 16)
    x[0, 0], x[1, 0] = 3.0, 9 / 1024
    return x


def element_tie() -> torch.Tensor:
    # Tensor amax 10, one block: both block scales 448 (TE: 10 x fl(fl(268.8) x fl(1/6)) = 447.99999 -> 448).
    # Ours: fl(448 x fl(10 / 2688)) = 1.6666666269 (under 5/3), its reciprocal 0.6000000238: 1.25 x that is
    # fl(0.75000003) = 0.75, the e2m1 tie of 0.5 and 1: to even, 1 (divided: 1.25 / 1.6666666 = 0.75000002).
    # TE: fl(1 / fl(268.8)) = 0.0037202383 (ours 0.0037202381), 448 x it = 1.6666667461 (over 5/3), the
    # reciprocal 0.59999996: 1.25 x that = 0.74999994, under the tie: 0.5.
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 10.0, 1.25
    return x


def test_a_block_scale_tie_rounds_as_each_order_computes_it():
    x = block_scale_tie()
    for spec in (DECODE, RECIP):
        assert quantize(x, spec).scales.flatten().tolist() == [448.0, 1.25]
    assert quantize(x, TE).scales.flatten().tolist() == [448.0, 1.375]
    # 9/1024 in scale units: ours 6.3 (6.0), TE 5.73 (6.0); code 7 either way, the value follows the scale
    ts = torch.tensor(3.0) / 2688  # the tensor scale a value dequantizes with, in both orders
    assert codes(x, TE)[16] == codes(x, RECIP)[16] == 7
    assert fake_quantize(x, RECIP)[1, 0].item() == (torch.tensor(6 * 1.25) * ts).item()
    assert fake_quantize(x, TE)[1, 0].item() == (torch.tensor(6 * 1.375) * ts).item()


def test_an_element_tie_rounds_as_each_order_computes_it():
    x = element_tie()
    assert (
        quantize(x, TE).scales.flatten().tolist() == quantize(x, RECIP).scales.flatten().tolist() == [448.0]
    )
    assert codes(x, DECODE)[1] == codes(x, RECIP)[1] == 2  # 1.0
    assert codes(x, TE)[1] == 1  # 0.5
    ts = torch.tensor(10.0) / 2688
    assert fake_quantize(x, RECIP)[0, 1].item() == (448 * ts).item()
    assert fake_quantize(x, TE)[0, 1].item() == (224 * ts).item()


def zero_signs() -> torch.Tensor:
    # Tensor amax 2**20 (one block): TE's encode scale 2688 x 2**-20 (exact), block scale 448, multiplier
    # fl(1 / fl(448 x fl(2**13 / 21))) = 5.722046e-06. Element 1 is -0; element 2 is -2**-149 (fp32's
    # smallest), whose product underflows to -0; element 3 is -100000, -0.572 in scale units, which rounds to
    # -0.5; element 4 is -1, -5.7e-06 in scale units, a nonzero negative that rounds to 0.
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3], x[0, 4] = 2.0**20, -0.0, -(2.0**-149), -100000.0, -1.0
    return x


def test_a_zero_after_the_multiply_is_plus_zero_under_te():
    # TE's e2m1 cast codes a product that is 0 (either sign) as +0 (code 0) and a negative one that rounds to
    # 0 as -0 (code 8); ours takes every sign from x: -0 and the underflowed product are -0 (code 8).
    x = zero_signs()
    assert codes(x, RECIP)[1:5] == [8, 8, 9, 8]
    assert codes(x, TE)[1:5] == [0, 0, 9, 8]
    signs = torch.signbit(fake_quantize(x, TE))[0, 1:5].tolist()
    assert signs == [False, False, True, True]
    assert torch.signbit(fake_quantize(x, RECIP))[0, 1:5].tolist() == [True, True, True, True]


CASES = {"block_scale_tie": block_scale_tie, "element_tie": element_tie, "zero_signs": zero_signs}


def _paths() -> dict:
    compiled = torch.compile(lambda t: cast(t, TE), fullgraph=True)
    return {
        "fake_quantize": lambda t: fake_quantize(t, TE),
        "quantize": lambda t: dequantize(quantize(t, TE)),
        "cast": lambda t: cast(t, TE),  # nn's GEMM operand cast
        "cast_compiled": compiled,
        "group_cast": lambda t: group_cast(t, TE, torch.zeros(t.shape[0], dtype=torch.long), 1),  # MoE
    }


@pytest.mark.parametrize("case", list(CASES))
def test_every_cast_path_gives_te_bits(case):
    x = CASES[case]()
    want = fake_quantize(x, TE)
    if case != "zero_signs":  # that one differs in the signs of zeros only (equal as numbers)
        assert not torch.equal(want, fake_quantize(x, RECIP))
    for name, path in _paths().items():
        got = path(x)
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit()), name


def test_per_expert_casts_take_each_experts_own_encode_scale():
    # Two experts, the two hand-computed cases: each expert's rows under its own tensor amax (3 and 10).
    a, b = block_scale_tie(), element_tie()
    x = torch.cat([a, b])
    gid = torch.tensor([0] * len(a) + [1] * len(b))
    want = torch.cat([fake_quantize(a, TE), fake_quantize(b, TE)])
    assert torch.equal(group_cast(x, TE, gid, 2), want)
    compiled = torch.compile(lambda t, g: group_cast(t, TE, g, 2), fullgraph=True)
    assert torch.equal(compiled(x, gid), want)


def tie_heavy(rows: int = 32, seed: int = 0) -> np.ndarray:
    """Rows of 16: an amax, then values whose exact quotient by the scale amax / 6 is an e2m1 midpoint, each
    moved 0-2 fp32 ulps: where the two orders' multipliers (an ulp apart) round differently."""
    g = np.random.default_rng(seed)
    x = np.zeros((rows, 16), F32)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    for r in range(rows):
        amax = F32(g.choice([5.0, 10.0, 19.0, 20.0, 29.0, 3.0, 7.0]) * 2.0 ** g.integers(-4, 5))
        x[r, 0] = amax
        vals = (g.choice(mids, 15) * amax / 6).astype(F32)
        x[r, 1:] = np.nextafter(vals, np.where(g.random(15) < 0.5, np.inf, 0).astype(F32))
        x[r, 1:] = np.where(g.random(15) < 0.4, vals, x[r, 1:]) * np.where(g.random(15) < 0.5, -1, 1)
    return x.reshape(rows // 4, 64)  # 4 blocks a row; each block's own amax under one tensor amax


@pytest.mark.parametrize("spec,tile", [(TE, 1), (TILE_TE, 16)], ids=["1x16", "16x16"])
def test_te_order_equals_the_reference(spec, tile):
    # With TE's underflow rule too ("zero"): rows 1e-7 of the largest have block scales that round to 0.
    spec = dataclasses.replace(spec, scale_underflow="zero")
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(32, 64, generator=g) * 10.0 ** torch.randint(-7, 3, (32, 1), generator=g)
    rows[3] = 0.0  # zero blocks: TE stores the block scale 0, we keep 1 (the same values)
    for x in (tie_heavy(64), rows.numpy()):
        _, block, deq = te_reference(x, tile)
        got = quantize(torch.from_numpy(x), spec).scales.numpy().reshape(block.shape)
        zero = np.abs(x.reshape(block.shape[0], tile, -1, 16)).max(axis=(1, 3), keepdims=True) == 0
        assert np.array_equal(np.where(zero, 1, block), got)
        assert (block == 0).sum() > zero.sum() or x is not rows.numpy()  # underflowing blocks were there
        assert np.array_equal(fake_quantize(torch.from_numpy(x), spec).numpy(), deq)
    x = tie_heavy(64)
    other = fake_quantize(torch.from_numpy(x), dataclasses.replace(spec, scale_order="decode")).numpy()
    assert (other != te_reference(x, tile)[2]).mean() > 0.01  # measured 13.9% (1x16), 2.6% (16x16)


def test_edge_tensors():
    # All zero (-0 included): every value +0, no NaN; a zero block keeps our scale 1 (TE stores 0: the same
    # values), the multiplier is capped at fp32's max (TE: 2688 / 0 -> its cap, fl(1 / cap) = 2**-128).
    z = torch.zeros(2, 16)
    z[1] = -0.0
    y = fake_quantize(z, TE)
    assert not y.signbit().any() and not y.isnan().any() and codes(z, TE) == [0] * 32
    assert quantize(z, TE).scales.flatten().tolist() == [1.0, 1.0]
    # A tensor amax below 2688 / fp32's max (here 2**-120): TE's encode scale saturates at fp32's max, so
    # its amax block's scale is round(2**-120 x fl(fp32 max x fl(1 / 6))) = round(42.67) = 44, not 448 (a TE
    # quirk "te" keeps; ours gives 448).
    t = torch.zeros(1, 16)
    t[0, 0] = 2.0**-120
    assert quantize(t, TE).scales.item() == 44.0 and quantize(t, RECIP).scales.item() == 448.0
    # An infinite amax: TE's encode scale 2688 / inf = 0 becomes 1, so block scales are round(amax_b x
    # fl(1 / 6)), the infinite block's capped at 448; the inf itself is code 7 (6).
    i = torch.zeros(2, 16)
    i[0, 0], i[1, 0], i[1, 1] = float("inf"), 6.0, 3.0
    assert quantize(i, TE).scales.flatten().tolist() == [448.0, 1.0]
    assert codes(i, TE)[0] == 7 and codes(i, TE)[16:18] == [7, 5]
    # NaN anywhere: TE's tensor amax is NaN, and so is every value.
    n = i.clone()
    n[0, 0] = float("nan")
    assert fake_quantize(n, TE).isnan().all()


def test_what_te_needs_and_a_rule_sets_it():
    for bad in (
        dict(scale_apply="divide"),
        dict(tensor_scale=False),
        dict(four_over_six="mse"),
        dict(scale_rounding="ceil"),
    ):
        with pytest.raises(
            ValueError,
            match=r"scale_order='te' needs tensor_scale=True \('te': or fp32 blocks / tiles without a "
            r"margin\), scale_rounding 'exact'",
        ):
            dataclasses.replace(TE, **bad)
    with pytest.raises(ValueError, match="multiplies by two_level_scales' inverse"):
        in_scale_units(torch.ones(1, 16), torch.ones(1, 1), TE)
    with pytest.raises(
        ConfigError, match=r"^quantize.rules.scale_order = 'nvidia': expected one of decode, te, torchao$"
    ):
        QuantRule(scale_order="nvidia")
    rule = QuantRule(roles=["forward.*"], scale_apply="reciprocal", scale_order="te")
    plan = resolve_plan(
        QuantizeConfig(recipe="nvfp4", skip=[], rules=[rule]), {"l": LayerShape(256, 256, 128)}
    )
    assert plan["l"].spec("forward.input").scale_order == "te"
    assert ",recip,teorder)" in plan["l"].spec("forward.input").short()
    assert plan["l"].spec("dgrad.grad_output").scale_order == "decode"
    divide = QuantRule(roles=["forward.*"], scale_order="te")
    with pytest.raises(ConfigError, match=r"quantize.rules\[0\]: QuantSpec.scale_order='te' needs"):
        resolve_plan(
            QuantizeConfig(recipe="nvfp4", skip=[], rules=[divide]), {"l": LayerShape(256, 256, 128)}
        )
