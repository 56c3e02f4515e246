"""The fast tensor path held bit for bit to the scalar reference (formats/reference.py), and the reference
itself checked against a brute-force nearest-code search and hand-written spot values."""

from __future__ import annotations

import math

import pytest
import torch
from formats_helpers import assert_same_bits, finite_grid, probe_values
from hypothesis import given, settings
from hypothesis import strategies as st

from low_bits_training.formats import get_format, round_to
from low_bits_training.formats import native as native_mod
from low_bits_training.formats import rounding as rounding_mod
from low_bits_training.formats.reference import ref_decode, ref_round
from low_bits_training.formats.rounding import round_magnitude

NAMES = [
    "e4m3",
    "e5m2",
    "e3m2",
    "e2m3",
    "e2m1",
    "e8m0",
    "ue4m3",
    "int8",
    "int4",
    "e3m4",
    "e2m5",
    "fp16",
    "bf16",
]
ROUNDINGS = ["nearest", "toward_zero"]


def _ref(x: torch.Tensor, name: str, rounding: str, saturate: bool) -> torch.Tensor:
    return torch.tensor([ref_round(v, name, rounding, saturate) for v in x.tolist()], dtype=torch.float32)


@pytest.fixture(params=["fast", "no-native-fp8", "generic"])
def impl(request, monkeypatch):
    """Run a test on the fast paths with the round trip through torch's fp8 casts for both fp8 dtypes (what
    compiled CPU code and CUDA run for e4m3; eager CPU code for e5m2), on the fast paths without the casts
    (the add/sub trick: eager CPU e4m3, compiled CPU e5m2), and on the generic exponent-based path."""
    monkeypatch.setattr(rounding_mod, "FAST_PATHS", request.param != "generic")
    monkeypatch.setattr(native_mod, "NATIVE_FP8_CASTS", request.param == "fast")
    monkeypatch.setattr(native_mod, "EAGER_CPU_ROUND_TRIP_DTYPES", native_mod.FP8_CAST_DTYPES)
    return request.param


@pytest.mark.parametrize("saturate", [True, False])
@pytest.mark.parametrize("rounding", ROUNDINGS)
@pytest.mark.parametrize("name", NAMES)
def test_fast_equals_reference_on_probes(name, rounding, saturate, impl):
    x = probe_values(name, n_random=1500, seed=5) if not name.startswith("int") else _int_probes()
    if x.numel() > 5000:  # fp16 / bf16: a fixed random subset keeps the scalar reference quick
        x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))[:5000]]
    assert_same_bits(round_to(x, name, rounding, saturate), _ref(x, name, rounding, saturate), name)


def _int_probes() -> torch.Tensor:
    base = torch.arange(-300, 301, dtype=torch.float32) / 2  # every tie k + 0.5
    rnd = torch.randn(2000, generator=torch.Generator().manual_seed(0)) * 60
    return torch.cat([base, rnd, torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, 1e30])])


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "e8m0"])
def test_stochastic_generic_equals_reference_given_the_same_draws(name, monkeypatch):
    # The generic path draws u = torch.rand(shape, generator); the reference takes u explicitly.
    monkeypatch.setattr(rounding_mod, "FAST_PATHS", False)
    x = probe_values(name, n_random=1000, seed=6)
    x = x[torch.isfinite(x) & (x >= 0)]
    got = round_to(x, name, "stochastic", generator=torch.Generator().manual_seed(7))
    u = torch.rand(x.shape, generator=torch.Generator().manual_seed(7)).tolist()
    want = [ref_round(v, name, "stochastic", True, ui) for v, ui in zip(x.tolist(), u, strict=True)]
    assert_same_bits(got, torch.tensor(want), name)


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "ue4m3", "e3m4", "bf16"])
def test_stochastic_bits_path_equals_reference_given_the_same_draws(name):
    # The fast path draws R = randint(0, 2**d) and rounds up iff low bits + R >= 2**d, i.e. the reference's
    # rule with u = (2**d - 1 - R) / 2**d. Exact for inputs whose bits are no finer than 2**(emin - 23).
    fmt = get_format(name)
    x = probe_values(name, n_random=1000, seed=13)
    x = x[torch.isfinite(x) & (x >= 0)]
    x = x[(x >= fmt.min_normal) | (torch.fmod(x, 2.0 ** (fmt.emin - 23)) == 0)][:5000]
    got = round_to(x, name, "stochastic", generator=torch.Generator().manual_seed(7))
    d = 23 - fmt.mbits
    r = torch.randint(0, 1 << d, x.shape, generator=torch.Generator().manual_seed(7), dtype=torch.int32)
    u = ((2**d - 1 - r).double() / 2**d).tolist()
    want = [ref_round(v, name, "stochastic", True, ui) for v, ui in zip(x.tolist(), u, strict=True)]
    assert_same_bits(got, torch.tensor(want), name)


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e3m2", "e2m1", "e8m0", "int4"])
def test_reference_is_the_nearest_code(name):
    """Brute force: the nearest finite grid value, ties to the even code (upper neighbour for e8m0)."""
    fmt = get_format(name)
    grid = finite_grid(name).tolist()
    xs = (
        probe_values(name, n_random=300, seed=8).tolist()
        if not name.startswith("int")
        else _int_probes().tolist()
    )
    for x in xs:
        if not math.isfinite(x) or abs(x) > fmt.max or (not fmt.signed and x <= 0):
            continue
        best = min(abs(x - g) for g in grid)
        cands = [g for g in grid if abs(x - g) == best]
        r = ref_round(x, name)
        assert r in cands, (x, r, cands)
        if len({abs(c) for c in cands}) > 1:  # a true tie: even significand
            assert r == _even_choice(cands, fmt), (x, r, cands)


def _even_choice(cands, fmt):
    lo, hi = sorted(cands, key=abs)[:1][0], sorted(cands, key=abs)[-1]
    if getattr(fmt, "mbits", 1) == 0:
        return hi
    q = abs(hi) - abs(lo)
    return lo if round(abs(lo) / q) % 2 == 0 else hi


SPOTS = [  # (format, x, saturate, expected)
    ("e4m3", 448.0, True, 448.0),
    ("e4m3", 464.0, False, 448.0),  # tie between 448 (mantissa 110) and the NaN slot 480 -> even 448
    ("e4m3", 464.5, False, math.nan),
    ("e4m3", math.inf, False, math.nan),
    ("e4m3", -math.inf, True, -448.0),
    ("e4m3", 2.0**-9, True, 2.0**-9),  # min subnormal
    ("e4m3", 2.0**-10, True, 0.0),  # tie 0 / min subnormal -> 0 (even)
    ("e4m3", 3 * 2.0**-10, True, 2.0**-8),  # tie 2**-9 / 2**-8 -> 2**-8 (mantissa 010)
    ("e4m3", 1.0625, True, 1.0),  # tie 1.0 / 1.125 -> 1.0
    ("e4m3", 1.1875, True, 1.25),  # tie 1.125 / 1.25 -> 1.25
    ("e4m3", -0.0, True, -0.0),
    ("e5m2", 57344.0, False, 57344.0),
    ("e5m2", 61440.0, False, math.inf),  # tie 57344 / (65536 = inf slot): 57344 has odd mantissa 11
    ("e5m2", 61439.0, False, 57344.0),
    ("e5m2", 1e9, True, 57344.0),
    ("e5m2", 2.0**-16, True, 2.0**-16),  # min subnormal
    ("e5m2", 2.0**-17, True, 0.0),
    ("e2m1", 5.0, True, 4.0),  # tie 4 / 6 -> 4 (mantissa 0)
    ("e2m1", 0.25, True, 0.0),  # tie 0 / 0.5
    ("e2m1", 0.75, True, 1.0),  # tie 0.5 / 1.0 -> 1.0
    ("e2m1", 100.0, False, 6.0),  # no inf / NaN: always clamps
    ("e3m2", 28.0, True, 28.0),
    ("e3m2", 2.0**-4, True, 2.0**-4),
    ("e2m3", 7.5, True, 7.5),
    ("e2m3", 2.0**-3, True, 2.0**-3),
    ("e8m0", 3.0, True, 4.0),  # ties go up (torch / ml_dtypes)
    ("e8m0", 0.0, True, 2.0**-127),  # no zero in e8m0
    ("e8m0", -1.0, True, math.nan),
    ("int8", 127.5, True, 127.0),
    ("int8", 2.5, True, 2.0),
    ("int8", -300.0, False, -127.0),
    ("int4", -7.5, True, -7.0),
]


@pytest.mark.parametrize("name,x,saturate,expected", SPOTS)
def test_spot_values(name, x, saturate, expected):
    got = round_to(torch.tensor([x]), name, saturate=saturate).item()
    ref = ref_round(x, name, saturate=saturate)
    for v in (got, ref):
        assert (math.isnan(v) and math.isnan(expected)) or (
            v == expected and math.copysign(1, v) == math.copysign(1, expected)
        ), (v, expected)


def test_format_table_spot_properties():
    assert [get_format(n).max for n in ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1", "int8", "int4"]] == [
        448.0, 57344.0, 28.0, 7.5, 6.0, 127.0, 7.0]  # fmt: skip
    assert get_format("e8m0").max == 2.0**127 and get_format("e8m0").min_subnormal == 2.0**-127
    assert get_format("e4m3").min_subnormal == 2.0**-9 and get_format("e5m2").min_subnormal == 2.0**-16
    assert get_format("fp16").max == 65504.0 and get_format("bf16").max == float(
        torch.finfo(torch.bfloat16).max
    )
    assert get_format("fp32").min_subnormal == float(torch.finfo(torch.float32).smallest_normal) * 2.0**-23
    assert get_format("fp8_e4m3") is get_format("e4m3") and get_format("ue4m3").bits == 7
    e3m4 = get_format("e3m4")
    assert (e3m4.max, e3m4.has_inf) == (15.5, True)  # IEEE-like, as ml_dtypes.float8_e3m4
    assert ref_decode(0x7F, "e4m3") != ref_decode(0x7F, "e4m3")  # NaN
    assert ref_decode(0x7C, "e5m2") == math.inf


def test_get_format_error_names_value_and_allowed():
    with pytest.raises(ValueError, match=r"unknown format 'e9m9'.*e4m3.*eXmY"):
        get_format("e9m9")


finite_f32 = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)


@settings(max_examples=300, deadline=None)
@given(x=finite_f32, name=st.sampled_from(NAMES), saturate=st.booleans(), rounding=st.sampled_from(ROUNDINGS))
def test_property_fast_equals_reference(x, name, saturate, rounding):
    t = torch.tensor([x], dtype=torch.float32)
    assert_same_bits(round_to(t, name, rounding, saturate), _ref(t, name, rounding, saturate), name)


def test_round_magnitude_ignores_sign_handling():
    # Internal contract used by the scaling path: magnitudes in, magnitudes out.
    a = torch.tensor([0.0, 1.0625, 500.0])
    assert round_magnitude(a, get_format("e4m3"), "nearest", True).tolist() == [0.0, 1.0, 448.0]


def test_torch_compile_matches_eager_bit_for_bit():
    """The compiled kernels (inductor C++) keep the numerics: -0, NaN, inf, ties, subnormals, overflow. One
    graph holds several paths (one compile): magic-add RNE, the fp8 dtypes' casts (compiled on CPU), fp4 and
    fp6 with the binade's spacing picked by comparisons (compiled on CPU, nearest and stochastic, the latter
    from int32 random words), e8mY bit RNE (inductor folds bf16 cast pairs, which is why bf16 does not
    use a cast), MX, NVFP4 (scales in their own buffer: ``group_scales(own_buffer=...)``, column scales
    only and all scales), blocks along a leading dim, and the generic path."""
    from dataclasses import replace

    from low_bits_training.formats import QuantSpec, fake_quantize

    elems = torch.cat(
        [probe_values("e4m3", n_random=4000, seed=11), probe_values("e2m1", n_random=4000, seed=12)]
        + [probe_values(f, n_random=1000, seed=13) for f in ("e2m3", "e3m2")]
    )
    x = elems[: elems.numel() // 2048 * 2048].reshape(-1, 64)  # rows: a multiple of 32 (blocks along dim 0)
    x[torch.isinf(x)] = 1.0  # inf in a block would make the whole block's scale huge; tested elsewhere
    mx_cols = replace(QuantSpec.mxfp8(), axis=0)

    key = torch.tensor(20261124, dtype=torch.int64)

    def fn(t, e, k):
        return (
            round_to(e, "e2m1", "stochastic", generator=k),
            round_to(e * 0.37, "e2m1", "stochastic", generator=k),  # subnormal and in-binade positions
            round_to(e, "e2m3"),
            round_to(e, "e3m2", "stochastic", generator=k),
            fake_quantize(t, QuantSpec.mxfp6(), own_buffer="all"),
            fake_quantize(t, QuantSpec.nvfp4(rounding="stochastic"), k),
            fake_quantize(t, QuantSpec.mxfp8(), own_buffer="all"),
            fake_quantize(t, QuantSpec.fp8_tensorwise(), own_buffer="all"),
            fake_quantize(t, QuantSpec.nvfp4(), own_buffer="all"),
            round_to(e, "e4m3", saturate=False),
            round_to(e, "e4m3"),
            round_to(e, "e5m2", saturate=False),
            round_to(e, "e2m1"),
            round_to(e, "bf16"),
            round_to(e, "e8m0"),
            round_to(e, "int4", "toward_zero"),
            fake_quantize(t, QuantSpec.mxfp4()),
            fake_quantize(t, mx_cols),
            fake_quantize(t, QuantSpec.nvfp4()),
            fake_quantize(t, QuantSpec.fp8_rowwise()),
        )

    for got, want in zip(torch.compile(fn, dynamic=False)(x, elems, key), fn(x, elems, key), strict=True):
        assert_same_bits(got, want, "compiled vs eager")
