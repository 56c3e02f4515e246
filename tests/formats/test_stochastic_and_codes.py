"""Stochastic rounding statistics and reproducibility; quantize / dequantize / packing round trips."""

from __future__ import annotations

import pytest
import torch

from low_bits_training.formats import (
    QuantSpec,
    dequantize,
    fake_quantize,
    finite_grid_values,
    pack,
    quantize,
    round_to,
    unpack,
)

SR_CASES = [("e4m3", 1.03), ("e4m3", -300.0), ("e5m2", 0.0007), ("e2m1", 2.6), ("e2m1", 0.1), ("e3m2", 11.0),
            ("int8", 3.3), ("bf16", 1.0 + 2.0**-9), ("e4m3", 2.0**-11)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name,value", SR_CASES)
def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours(name, value, dtype):
    n = 20000
    x = torch.full((n,), value, dtype=torch.float32)
    v = x.to(dtype).float()[0].item()  # the value actually fed in
    y = round_to(x.to(dtype), name, "stochastic", generator=torch.Generator().manual_seed(0)).float()
    lo = round_to(torch.tensor([v]), name, "toward_zero").item()
    grid = finite_grid_values(name)
    away = min(g for g in grid if g > lo) if v > 0 else max(g for g in grid if g < lo)
    hi = lo if lo == v else away  # the neighbour away from zero
    assert set(y.unique().tolist()) <= {lo, hi}
    p = (v - lo) / (hi - lo) if hi != lo else 0.0
    sigma = abs(hi - lo) * (p * (1 - p) / n) ** 0.5
    assert abs(y.double().mean().item() - v) <= 3 * sigma + 1e-12, (y.mean().item(), v, sigma)


def test_stochastic_rounding_reproducible_per_seed():
    x = torch.randn(4096)
    a = round_to(x, "e2m1", "stochastic", generator=torch.Generator().manual_seed(3))
    b = round_to(x, "e2m1", "stochastic", generator=torch.Generator().manual_seed(3))
    c = round_to(x, "e2m1", "stochastic", generator=torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    spec = QuantSpec.mxfp4(rounding="stochastic")
    g = lambda s: torch.Generator().manual_seed(s)  # noqa: E731
    assert torch.equal(fake_quantize(x.view(64, 64), spec, g(1)), fake_quantize(x.view(64, 64), spec, g(1)))
    assert not torch.equal(
        fake_quantize(x.view(64, 64), spec, g(1)), fake_quantize(x.view(64, 64), spec, g(2))
    )


def test_toward_zero_never_increases_magnitude():
    x = torch.randn(10000) * 100
    y = round_to(x, "e4m3", "toward_zero")
    assert (y.abs() <= x.abs()).all() and (y * x >= 0).all()


SPECS = [QuantSpec.mxfp8(scale_rounding="floor"), QuantSpec.mxfp8("e5m2", "rceil"), QuantSpec.mxfp6(), QuantSpec.mxfp6("e3m2"),
         QuantSpec.mxfp4(), QuantSpec.nvfp4(), QuantSpec.fp8_tensorwise(), QuantSpec.fp8_rowwise("e5m2"),
         QuantSpec.deepseek_weight(), QuantSpec.deepseek_act(), QuantSpec.int8_rowwise(),
         QuantSpec("int4", "block", block_size=32), QuantSpec("e3m2", "none"),
         QuantSpec("e4m3", "tensor", rounding="stochastic", saturate=False)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_dequantize_of_quantize_equals_fake_quantize(spec, dtype):
    x = (torch.randn(128, 256, generator=torch.Generator().manual_seed(0)) * 5).to(dtype)
    q = quantize(x, spec, torch.Generator().manual_seed(9))
    assert q.codes.dtype == torch.uint8
    per_byte = 2 if spec.elem.bits <= 4 else 1
    assert q.codes.numel() == x.numel() // per_byte
    y = dequantize(q)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, fake_quantize(x, spec, torch.Generator().manual_seed(9)))


def test_pack_unpack_nibble_order_and_odd_length():
    codes = torch.tensor([1, 2, 3, 4, 5], dtype=torch.uint8)
    packed = pack(codes, 4)
    assert packed.tolist() == [0x21, 0x43, 0x05]  # element 2i in the low nibble
    assert torch.equal(unpack(packed, 4, 5), codes)
    assert torch.equal(pack(codes, 6), codes)


def test_fake_quantize_keeps_shape_dtype_and_is_idempotent():
    x = torch.randn(3, 64, 32, dtype=torch.bfloat16)
    spec = QuantSpec("e2m3", "block", axis=1, block_size=32, scale_format="e8m0", scale_rounding="floor")
    y = fake_quantize(x, spec)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.equal(fake_quantize(y, spec), y)
