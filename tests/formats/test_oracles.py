"""round_to / decode / encode bit for bit against outside oracles: torch's float8 casts and ml_dtypes."""

from __future__ import annotations

import pytest
import torch
from formats_helpers import assert_same_bits, ml_cast, ml_codes, probe_values

from low_bits_training.formats import decode, encode, get_format, round_to
from low_bits_training.formats.native import E4M3_CAST_SATURATES

DTYPES = [torch.float32, torch.bfloat16]

# (format, ml_dtypes saturate flag that reproduces ml_dtypes' cast). ml_dtypes: e4m3fn overflow -> NaN;
# e5m2 -> inf; fp6/fp4 always clamp (no inf/NaN), so saturate=False must clamp too.
ML_CASES = [("e4m3", False), ("e5m2", False), ("e3m2", False), ("e3m2", True), ("e2m3", False),
            ("e2m3", True), ("e2m1", False), ("e2m1", True), ("e3m4", False), ("bf16", False)]  # fmt: skip
TORCH_CASES = [("e4m3", torch.float8_e4m3fn, True), ("e5m2", torch.float8_e5m2, False)]


def _no_nan_format(name: str) -> bool:
    return not get_format(name).has_nan


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "e8m0", "e3m4"])
def test_decode_every_code_matches_ml_dtypes(name):
    fmt = get_format(name)
    codes = torch.arange(fmt.n_codes, dtype=torch.int32).to(torch.uint8)
    assert_same_bits(decode(codes, fmt), ml_codes(name), f"decode {name}")


@pytest.mark.parametrize(
    "name", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "e8m0", "ue4m3", "e3m4", "int8", "int4"]
)
@pytest.mark.parametrize("saturate", [True, False])
def test_round_to_is_identity_on_every_code_and_encode_inverts_decode(name, saturate):
    fmt = get_format(name)
    codes = torch.arange(fmt.n_codes, dtype=torch.int32).to(torch.uint8)
    if name == "int8":
        codes = codes[codes != 0x80]  # -128 is outside the symmetric range
    if name == "int4":
        codes = codes[codes != 0x8]
    vals = decode(codes, fmt)
    finite = torch.isfinite(vals)
    assert_same_bits(round_to(vals[finite], fmt, saturate=saturate), vals[finite], f"identity {name}")
    back = decode(encode(vals, fmt), fmt)
    assert_same_bits(back, vals, f"decode(encode) {name}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,saturate", ML_CASES)
def test_round_to_matches_ml_dtypes(name, saturate, dtype):
    x = probe_values(name).to(dtype)
    got = round_to(x, name, saturate=saturate)
    assert got.dtype == dtype
    want = ml_cast(x.float(), name).to(dtype)
    if _no_nan_format(name):  # ml_dtypes turns NaN into -0 (no NaN code); we keep NaN
        nan = torch.isnan(x)
        assert torch.isnan(got[nan]).all()
        got, want = got[~nan], want[~nan]
    assert_same_bits(got, want, f"{name} sat={saturate} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,torch_dtype,saturate", TORCH_CASES)
def test_round_to_matches_torch_cast(name, torch_dtype, saturate, dtype):
    # torch 2.14's float8_e4m3fn cast saturates (inf -> 448); float8_e5m2 follows IEEE (overflow -> inf).
    x = probe_values(name, seed=1).to(dtype)
    got, want = round_to(x, name, saturate=saturate), x.to(torch_dtype).to(dtype)
    if not E4M3_CAST_SATURATES and torch_dtype == torch.float8_e4m3fn:
        # torch 2.11 / 2.12 (scripts/torch_range.sh): a value past 448 casts to NaN; ours saturates there too
        past = torch.isnan(want) & ~torch.isnan(x)
        assert (x[past].float().abs() > 448).all() and (got[past].float().abs() == 448).all()
        got, want = got[~past], want[~past]
    assert_same_bits(got, want, f"{name} vs torch {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_e8m0_matches_torch_and_ml_dtypes_on_positive_values(dtype):
    # Scale format: only non-negative inputs are meaningful. torch maps 0 and tiny values to 2**-127 (no
    # zero in e8m0) as we do; ml_dtypes gives NaN for 0, so it is compared on x > 0 only.
    x = probe_values("e8m0", seed=2).to(dtype)
    x = x[((x >= 0) | torch.isnan(x)) & ~_E8M0_PATTERN_ROUNDED(x.float())]
    got = round_to(x, "e8m0", saturate=False)
    assert_same_bits(got, x.to(torch.float8_e8m0fnu).to(dtype), f"e8m0 vs torch {dtype}")
    pos = (x > 0) | torch.isnan(x)
    assert_same_bits(got[pos], ml_cast(x[pos].float(), "e8m0").to(dtype), f"e8m0 vs ml_dtypes {dtype}")


def _E8M0_PATTERN_ROUNDED(x: torch.Tensor) -> torch.Tensor:  # noqa: N802
    """fp32 subnormals in (2**-127, 1.5 * 2**-127): torch and ml_dtypes round the fp32 *bit pattern* (mantissa
    above half -> next exponent) and give 2**-126; the nearest e8m0 value is 2**-127. Deliberate difference."""
    return (x > 2.0**-127) & (x < 1.5 * 2.0**-127)


def test_e8m0_deliberate_difference_on_fp32_subnormals():
    x = torch.tensor([1.2 * 2.0**-127])
    assert round_to(x, "e8m0").item() == 2.0**-127  # nearest
    assert x.to(torch.float8_e8m0fnu).float().item() == 2.0**-126  # torch (and ml_dtypes) round up


@pytest.mark.parametrize("name,torch_dtype", [("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_encode_matches_torch_bit_patterns(name, torch_dtype):
    x = probe_values(name, seed=3)
    y = round_to(x, name, saturate=name == "e4m3")
    keep = ~torch.isnan(y)  # NaN payload / sign conventions are not compared
    assert torch.equal(encode(y[keep], name), y[keep].to(torch_dtype).view(torch.uint8))


@pytest.mark.parametrize("name", ["e3m2", "e2m3", "e2m1"])
def test_encode_matches_ml_dtypes_bit_patterns(name):
    import ml_dtypes
    from formats_helpers import ML_DTYPES

    y = round_to(probe_values(name, seed=4), name)
    y = y[~torch.isnan(y)]
    want = y.numpy().astype(getattr(ml_dtypes, ML_DTYPES[name])).view("uint8")
    assert torch.equal(encode(y, name), torch.from_numpy(want.copy()))
