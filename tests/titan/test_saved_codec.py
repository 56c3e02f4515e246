"""titan/plan/saved.py's fast save codec against nn.saved.ReferenceCodec (formats.quantize / dequantize)."""

from __future__ import annotations

import pytest
import torch

from low_bits_training.config.saved import SavedFormat
from low_bits_training.formats import QuantSpec
from low_bits_training.nn.saved import ReferenceCodec
from low_bits_training.titan.plan.saved import SaveCodec, codec_of

SPECS = [
    QuantSpec("e4m3", "tensor"),
    QuantSpec("e5m2", "axis"),
    QuantSpec("e4m3", "axis", scale_format="e8m0", scale_rounding="floor"),
    QuantSpec("e4m3", "axis", scale_format="bf16"),
    QuantSpec("int8", "axis"),
    QuantSpec("e4m3", "block", block_size=32, scale_format="e8m0", scale_rounding="rceil"),
    QuantSpec("e2m1", "block", block_size=16, scale_format="ue4m3"),
    QuantSpec("e4m3", "tensor", saturate=False),
    QuantSpec("e3m2", "none"),
]


def _values(dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(6, 8, 64) * torch.logspace(-6, 3, 64)
    x[0, 0, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])
    x[1, 1, 5] = 1e6  # past e4m3's max: saturated, or its own NaN
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_decoded_saves_equal_the_reference_bit_for_bit(spec, dtype):
    x = _values(dtype)
    fast, ref = SaveCodec(spec), ReferenceCodec(spec)
    got, want = fast.decode(fast.encode(x)), ref.decode(ref.encode(x))
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num().view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.nan_to_num().view(torch.int16 if dtype == torch.bfloat16 else torch.int32))  # fmt: skip


def test_stored_bytes():
    x = _values(torch.float32)  # 3,072 elements in 48 rows of 64
    n = x.numel()
    assert (
        SaveCodec(QuantSpec("e4m3", "tensor")).nbytes(SaveCodec(QuantSpec("e4m3", "tensor")).encode(x))
        == n + 4
    )
    mx = QuantSpec("e2m1", "block", block_size=32, scale_format="e8m0", scale_rounding="floor")
    assert SaveCodec(mx).nbytes(SaveCodec(mx).encode(x)) == n // 2 + n // 32  # one-byte e8m0 scales
    rows = QuantSpec("e4m3", "axis", scale_format="e8m0", scale_rounding="floor")
    assert SaveCodec(rows).nbytes(SaveCodec(rows).encode(x)) == n + 48  # a one-byte scale per row
    bf16 = codec_of(SavedFormat(None, "bf16", 0, 0))
    assert bf16.nbytes(bf16.encode(x)) == 2 * n and bf16.fits(x) and not bf16.fits(x.bfloat16())
    assert codec_of(SavedFormat(None, None, 0, 0)) is None
