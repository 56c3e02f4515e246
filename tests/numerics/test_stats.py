"""Quantization statistics against hand-computed values on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from low_bits_training.formats import QuantSpec
from low_bits_training.numerics import (
    HIST_LO,
    N_BINS,
    FirstNonFinite,
    combine,
    exponent_histogram,
    identity,
    operand_stats,
    sqnr_db,
    summarize,
)

E4M3_UNSCALED = QuantSpec("e4m3", "none")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unscaled_e4m3_by_hand(dtype):
    # 0 -> 0 (not an underflow: it was zero), 2^-12 -> 0 (below half the min subnormal 2^-9: underflow),
    # 1 -> 1, 500 -> 448 (saturates), 3.25 -> 3.25 (on the grid: step 0.25 in [2, 4)).
    x = torch.tensor([0.0, 2.0**-12, 1.0, 500.0, 3.25], dtype=dtype)
    s = summarize(operand_stats(x, E4M3_UNSCALED))
    assert s["n"] == 5
    assert s["underflow"] == pytest.approx(1 / 4)
    assert s["saturation"] == pytest.approx(1 / 5)
    assert s["clipping"] == pytest.approx(1 / 5)  # 500 > 448 + 32 / 2
    assert s["amax"] == 500.0
    assert (s["scale_min"], s["scale_max"], s["scale_mean"]) == (1.0, 1.0, 1.0)
    signal = 2.0**-24 + 1 + 500.0**2 + 3.25**2
    noise = 2.0**-24 + 52.0**2
    assert s["sqnr_db"] == pytest.approx(10 * math.log10(signal / noise), rel=1e-9)
    hist = dict((HIST_LO + i, h) for i, h in enumerate(s["hist"]) if h)
    assert hist == {-12: 0.25, 0: 0.25, 1: 0.25, 8: 0.25}


def test_tensor_scale_and_exact_values():
    x = torch.tensor([[1.0, -2.0], [4.0, 0.5]])
    s = summarize(operand_stats(x, QuantSpec("e4m3", "tensor")))
    scale = torch.tensor(4.0 / 448.0).item()  # fp32 amax / max, exactly representable scale format fp32
    assert s["scale_min"] == pytest.approx(scale, rel=1e-7) and s["scale_max"] == s["scale_min"]
    assert s["saturation"] == 0.0 and s["underflow"] == 0.0
    # x / scale = 112, -224, 448, 56: all on the e4m3 grid -> no noise at all.
    assert s["sqnr_db"] == math.inf
    hist = {HIST_LO + i: h for i, h in enumerate(s["hist"]) if h}
    assert hist == {6: 0.25, 7: 0.25, 8: 0.25, 5: 0.25}


def test_block_scales_e8m0_floor():
    # two 1x4 blocks; MX floor: scale = 2^(floor(log2 amax) - emax_elem), e4m3 emax = 8
    x = torch.tensor([[1.0, 2.0, 3.0, 6.0], [0.25, 0.1, 0.0, 0.125]])
    spec = QuantSpec("e4m3", "block", block_size=4, scale_format="e8m0", scale_rounding="floor")
    s = summarize(operand_stats(x, spec))
    assert s["scale_max"] == 2.0 ** (2 - 8) and s["scale_min"] == 2.0 ** (-2 - 8)
    assert s["scale_mean"] == pytest.approx((2.0**-6 + 2.0**-10) / 2)
    assert s["amax"] == 6.0 and s["saturation"] == 0.0  # 6 / 2^-6 = 384 <= 448


def test_floor_scale_saturates():
    # amax 7.5 -> scale 2^(2-8); 7.5 / 2^-6 = 480 > 448: one saturated value of four
    x = torch.tensor([7.5, 1.0, 1.0, 1.0])
    spec = QuantSpec("e4m3", "block", block_size=4, scale_format="e8m0", scale_rounding="floor")
    s = summarize(operand_stats(x, spec))
    assert s["saturation"] == 0.25 and s["clipping"] == 0.25  # 480 > 448 + 16
    assert s["sqnr_db"] == pytest.approx(10 * math.log10((7.5**2 + 3) / (7.5 - 7.0) ** 2))


def test_clipping_counts_values_past_the_rounding_boundary_above_max():
    """Saturated: above the format's max; clipped: above max + half its top grid step (e4m3: 448 + 16), where
    round to nearest would have left the grid. NVFP4 on Gaussian data: a few percent saturated (a block's
    largest value lifted just past 6 when its ue4m3 scale rounds down), none clipped past 7."""
    from low_bits_training.formats.table import get_format
    from low_bits_training.nn import LinearPlan

    assert [get_format(n).max_step for n in ("e2m1", "e4m3", "e5m2", "e3m2", "int8")] == [
        2.0,
        32.0,
        8192.0,
        4.0,
        1.0,
    ]
    s = summarize(operand_stats(torch.tensor([450.0, 464.0, 465.0, 1.0]), E4M3_UNSCALED))
    assert (s["saturation"], s["clipping"]) == (0.75, 0.25)
    torch.manual_seed(0)
    nvfp4 = LinearPlan.from_recipe("nvfp4").specs[0]
    s = summarize(operand_stats(torch.randn(256, 1024), nvfp4))
    assert s["saturation"] > 0.02 and s["clipping"] == 0.0


def test_nonfinite_values_are_counted_not_propagated():
    x = torch.tensor([1.0, float("nan"), float("inf"), 2.0])
    s = summarize(operand_stats(x, E4M3_UNSCALED))
    assert s["nonfinite"] == 0.5 and s["amax"] == 2.0 and s["sqnr_db"] == math.inf


def test_int8_rowwise_underflow():
    # row amax 127 -> scale 1; 0.4 rounds to 0 (underflow), 0.6 to 1
    x = torch.tensor([[127.0, 0.4, 0.6, -3.0]])
    s = summarize(operand_stats(x, QuantSpec.int8_rowwise()))
    assert s["underflow"] == 0.25 and s["scale_max"] == 1.0
    assert s["sqnr_db"] == pytest.approx(10 * math.log10((127**2 + 0.16 + 0.36 + 9) / (0.16 + 0.16)))


def test_combine_equals_stats_of_the_union():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g) * torch.logspace(-6, 2, 8).unsqueeze(1)
    spec = QuantSpec.mxfp8("e4m3")
    whole = operand_stats(x, spec)
    parts = combine(operand_stats(x[:3], spec), operand_stats(x[3:], spec))
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=0)
    torch.testing.assert_close(combine(identity(), whole), whole, rtol=0, atol=0)


def test_sqnr_edge_cases_and_histogram_clipping():
    assert sqnr_db(100.0, 1.0) == 20.0
    assert sqnr_db(1.0, 0.0) == math.inf and sqnr_db(0.0, 1.0) == -math.inf
    h = exponent_histogram(torch.tensor([2.0**-100, 2.0**100, 0.0, float("nan"), 1.5]))
    assert h.shape == (N_BINS,) and h[0] == 1 and h[-1] == 1 and h[-HIST_LO] == 1 and h.sum() == 3


def test_first_nonfinite_names_the_first_flagged_tensor():
    f = FirstNonFinite()
    f.check("layers.0.wq", "forward.input", torch.ones(3))
    assert f.first() is None
    f.check("layers.1.wq", "forward.weight", torch.tensor([1.0, float("nan")]))
    f.check("layers.2.wq", "forward.input", torch.tensor([float("inf")]))
    assert f.first() == ("layers.1.wq", "forward.weight")
    f.reset()
    assert f.first() is None
