"""The dynamic-tree codebooks dt8 / udt8 (``formats.table.CodeFormat``, ``formats.codebook``) against torchao's
dynamic map and 8-bit quantizer (the oracle: bitsandbytes' map and rule as torchao 0.18 writes them), and
hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch
from torchao.optim.quant_utils import (
    create_dynamic_map,
    dequant_with_qmap,
    quantize_8bit_with_qmap,
    scale_tensor,
)

from low_bits_training.formats import (
    CodeFormat,
    QuantSpec,
    decode,
    dequantize,
    encode,
    fake_quantize,
    finite_grid_values,
    get_format,
    quantize,
    round_to,
)

BOOKS = {"dt8": True, "udt8": False}  # name -> signed


def _qmap(signed: bool) -> torch.Tensor:
    return torch.tensor(create_dynamic_map(signed=signed), dtype=torch.float32)


@pytest.mark.parametrize("name", list(BOOKS))
def test_table_equals_torchao_dynamic_map_value_for_value(name):
    f = get_format(name)
    assert isinstance(f, CodeFormat) and f.kind == "code" and f.bits == 8 and f.n_codes == 256
    assert f.signed == BOOKS[name]
    assert torch.equal(torch.tensor(f.values, dtype=torch.float32), _qmap(BOOKS[name]))
    assert finite_grid_values(name) == list(f.values)


def test_hand_computed_values_of_the_dynamic_tree():
    dt8, udt8 = get_format("dt8"), get_format("udt8")
    # signed: 127 negatives, 0, 127 positives below 1, and 1 (no -1); the smallest magnitude is the one midpoint
    # of [0.1, 1] times 1e-6; the largest below 1 is the last of 64 midpoints of [0.1, 1]: 1 - 0.9 / 128
    assert dt8.zero_code == 127 and dt8.values[-1] == 1.0 and dt8.max == 1.0
    assert dt8.values[128] == pytest.approx(0.55e-6, rel=1e-6) and dt8.values[126] == -dt8.values[128]
    assert dt8.values[254] == pytest.approx(1 - 0.9 / 128, rel=1e-7) and dt8.values[254] == -dt8.values[0]
    # unsigned: 0, then 2 midpoints of [0.1, 1] times 1e-6 (0.325e-6, 0.775e-6), ..., 1 - 0.9 / 256, 1
    assert udt8.zero_code == 0 and udt8.values[1] == pytest.approx(0.325e-6, rel=1e-6)
    assert udt8.values[2] == pytest.approx(0.775e-6, rel=1e-6)
    assert udt8.values[254] == pytest.approx(1 - 0.9 / 256, rel=1e-7)
    # each decade [10**(k-1), 10**k) of dt8's positives holds 2**(k+6) values, k = -6..0
    pos = torch.tensor(dt8.values[128:255], dtype=torch.float64)
    counts = [int(((pos >= 10.0 ** (k - 1)) & (pos < 10.0**k)).sum()) for k in range(-5, 1)]
    assert counts == [2, 4, 8, 16, 32, 64] and int((pos < 1e-6).sum()) == 1


@pytest.mark.parametrize("name", list(BOOKS))
def test_every_threshold_is_where_torchao_rounds_up(name):
    # Both rules are monotone in x, so agreeing at each threshold and one fp32 step below it means agreeing on
    # every fp32 input in [-1, 1].
    f, qmap = get_format(name), _qmap(BOOKS[name])
    t = torch.tensor(f.thresholds, dtype=torch.float32)
    below = torch.nextafter(t, torch.tensor(-math.inf))
    k = torch.arange(255)
    assert torch.equal(quantize_8bit_with_qmap(t, qmap).long(), k + 1)
    assert torch.equal(quantize_8bit_with_qmap(below, qmap).long(), k)
    assert torch.equal(encode(t, f).long(), k + 1) and torch.equal(encode(below, f).long(), k)


def test_ties_go_up_and_the_fp32_rule_differs_from_the_exact_midpoint_in_two_gaps():
    f = get_format("dt8")
    v = torch.tensor(f.values, dtype=torch.float64)
    mid = (v[:-1] + v[1:]) / 2
    exact = mid.float().double() == mid  # midpoints that are fp32 numbers: a tie goes to the larger code
    k = torch.nonzero(exact).flatten()
    assert len(k) > 100
    assert torch.equal(encode(mid[k].float(), f).long(), k + 1)
    off = [i for i, t in enumerate(f.thresholds) if t < mid[i]]
    assert off == [125, 128]  # between -3.25e-6 and -5.5e-7, and 5.5e-7 and 3.25e-6: one fp32 step lower


@pytest.mark.parametrize("name", list(BOOKS))
def test_quantize_of_random_blocks_equals_torchao_bit_for_bit(name):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(96, 512, generator=g) * torch.logspace(-7, 2, 96)[torch.randperm(96, generator=g), None]
    x[3, :256] = 0.0  # an all-zero block
    x[5, 7] = 0.0
    if not BOOKS[name]:
        x = x.abs()
    spec = QuantSpec(name, "block", block_size=256)
    q = quantize(x, spec)
    qmap = _qmap(BOOKS[name])
    scaled, scale = scale_tensor(x, 256)
    codes = quantize_8bit_with_qmap(scaled, qmap)
    assert torch.equal(q.codes, codes.reshape(-1))
    assert torch.equal(dequantize(q), dequant_with_qmap(codes, qmap, scale))
    assert torch.equal(fake_quantize(x, spec), dequantize(q))
    nonzero = x.reshape(-1, 256).abs().amax(-1) > 0  # torchao stores 1e-12 for a zero block, we store 1
    assert torch.equal(q.scales.reshape(-1)[nonzero], scale[nonzero])


@pytest.mark.parametrize("name", list(BOOKS))
def test_every_code_round_trips_and_ends_nan_and_negatives_clamp(name):
    f = get_format(name)
    codes = torch.arange(256, dtype=torch.uint8)
    values = decode(codes, f)
    assert torch.equal(values, torch.tensor(f.values, dtype=torch.float32))
    assert torch.equal(encode(values, f), codes)
    odd = torch.tensor([math.nan, 2.0, -2.0, -0.0, math.inf, -math.inf])
    lo = f.values[0]
    assert round_to(odd, f).tolist() == [0.0, 1.0, lo, 0.0, 1.0, lo]  # NaN -> 0; beyond the ends -> the ends


def test_stochastic_rounding_is_unbiased_and_toward_zero_takes_the_smaller_magnitude():
    f = get_format("dt8")
    lo, hi = f.values[200], f.values[201]
    x = torch.full((200_000,), lo + 0.3 * (hi - lo))
    y = round_to(x, f, "stochastic", generator=torch.Generator().manual_seed(1))
    assert set(y.unique().tolist()) == {lo, hi}
    assert (y == hi).float().mean().item() == pytest.approx(0.3, abs=0.005)
    keyed = round_to(x, f, "stochastic", generator=torch.tensor(5))  # counter-based bits: the same twice
    assert torch.equal(keyed, round_to(x, f, "stochastic", generator=torch.tensor(5)))
    pair = torch.tensor([lo + 0.9 * (hi - lo), -(lo + 0.9 * (hi - lo)), hi, -hi])
    assert round_to(pair, f, "toward_zero").tolist() == [lo, -lo, hi, -hi]


def test_bad_names_give_one_line_naming_the_codebooks():
    with pytest.raises(ValueError) as e:
        get_format("dt9")
    assert "'dt9'" in str(e.value) and "dt8" in str(e.value) and "udt8" in str(e.value)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="strictly ascending"):
        CodeFormat("bad", (0.0, 1.0, 0.5, -1.0))
    with pytest.raises(ValueError, match="power of two"):
        CodeFormat("bad", (-1.0, 0.0, 1.0))
