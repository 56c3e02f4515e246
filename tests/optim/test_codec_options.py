"""State codecs (layout, bytes, held to formats.dequantize) and one-line option errors."""

from __future__ import annotations

import pytest
import torch

from low_bits_training.formats import decode, dequantize, quantize
from low_bits_training.optim import AdamWOptions, SGDOptions, StateCodec, parse_state_format

QUANTIZED = [
    "int8_block128",
    "e4m3_block128",
    "int4_block128",
    "e2m1_block128",
    "e2m1_block32_e8m0",
    "e4m3_block32_e8m0",
    "e5m2_block128",
    "int8_block64_bf16",
    "e3m2_block32",
]


@pytest.mark.parametrize("name", QUANTIZED)
def test_codec_decode_equals_formats_dequantize_bit_for_bit(name):
    spec = parse_state_format(name)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 3, 8)[:, None]
    c = StateCodec(spec)
    parts = c.encode(x)
    assert {k: v.dtype for k, v in parts.items()} == c.dtypes()
    assert {k: tuple(v.shape) for k, v in parts.items()} == c.part_shapes((8, 256))
    assert torch.equal(c.decode(parts, (8, 256)), dequantize(quantize(x, spec)))


@pytest.mark.parametrize("name", [*QUANTIZED, "int4_block128_sr", "e2m1_block32_e8m0_sr", "e4m3_block128_sr"])
def test_codec_codes_and_scales_equal_formats_quantize_bit_for_bit(name):
    # The codec's own bit codes, packing and bf16 / e8m0 scale storage are formats.quantize's, stochastic
    # rounding (counter-based key) included.
    spec = parse_state_format(name)
    x = torch.randn(8, 256, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 8)[:, None]
    key = torch.tensor(1234, dtype=torch.int64)
    parts, q = StateCodec(spec).encode(x, key), quantize(x, spec, key)
    assert torch.equal(parts["_codes"].reshape(-1), q.codes)
    scales = (
        parts["_scales"].float()
        if parts["_scales"].dtype != torch.uint8
        else decode(parts["_scales"], spec.scale_format)
    )
    assert torch.equal(scales.reshape(-1), q.scales.reshape(-1))


@pytest.mark.parametrize(
    ("name", "bytes_per_elem"),
    [
        ("int8_block128", 1 + 4 / 128),
        ("int4_block128", 0.5 + 4 / 128),
        ("e2m1_block32_e8m0", 0.5 + 1 / 32),
        ("bf16", 2.0),
    ],
)
def test_bytes_per_element(name, bytes_per_elem):
    parts = StateCodec(parse_state_format(name)).encode(torch.randn(4, 256))
    assert sum(t.nbytes for t in parts.values()) / 1024 == pytest.approx(bytes_per_elem)


def test_rows_are_independent_so_row_shards_quantize_like_the_whole():
    x = torch.randn(6, 256)
    c = StateCodec(parse_state_format("e2m1_block32_e8m0"))
    whole = c.encode(x)
    top, bottom = c.encode(x[:3]), c.encode(x[3:])
    for k in whole:
        assert torch.equal(whole[k], torch.cat([top[k], bottom[k]]))


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"lr": 1e-3, "exp_avg": "int9_block128"}, "exp_avg='int9_block128'"),
        ({"lr": 1e-3, "exp_avg_sq": {"format": "e4m3", "scaling": "tile"}}, "exp_avg_sq="),
        (
            {"lr": 1e-3, "master_rounding": "up"},
            "master_rounding='up': allowed ['nearest', 'stochastic', 'kahan']",
        ),
        ({"lr": 1e-3, "master_rounding": "stochastic"}, "needs master_weights"),
        ({"lr": 1e-3, "betas": [0.9]}, "betas=[0.9]"),
        ({"lr": -1.0}, "lr=-1.0"),
        ({"lr": 1e-3, "exp_avgs": "bf16"}, "unknown key 'exp_avgs'"),
        ({"betas": [0.9, 0.95]}, "lr is required"),
    ],
)
def test_adamw_option_errors_are_one_line_and_name_the_key(kw, needle):
    with pytest.raises(ValueError) as e:
        AdamWOptions.from_group(kw)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_sgd_options_and_ignored_torch_keys():
    o = SGDOptions.from_group(
        {
            "lr": 0.1,
            "momentum_buffer": "bf16",
            "fused": True,
            "foreach": False,
            "param_names": ["a"],
            "initial_lr": 0.1,
        }
    )
    assert o.momentum == 0.9
    with pytest.raises(ValueError, match="momentum=0"):
        SGDOptions.from_group({"lr": 0.1, "momentum": 0})


def test_storing_scales_keeps_no_reference_to_them():
    """``store_scales`` once carried ``_lut``'s ``functools.cache`` by mistake: every scale tensor it was given
    (each optimizer step's, each save's) stayed alive for good."""
    import gc
    import weakref

    from low_bits_training.optim.codec import store_scales

    for fmt in ("fp32", "bf16", "e8m0", "ue4m3"):
        scale = torch.full((64, 1), 0.5)
        ref = weakref.ref(scale)
        stored = store_scales(scale, fmt)
        assert stored.shape == (64, 1)
        del scale, stored
        gc.collect()
        assert ref() is None, fmt


def test_the_default_adamw_states_are_int8_blocks_on_m_and_sqrt_v_at_2_062_bytes():
    """Issue 40's choice by measurement (docs/optimizers.md, ``bench_optim.py --direction / --probe``): int8
    blocks on sqrt(v) err 0.0071 on the update direction (e4m3: 0.0255) at the same 1 + 4/128 bytes."""
    o = AdamWOptions(lr=1e-3)
    specs = o.state_specs()
    assert specs == {
        "exp_avg": parse_state_format("int8_block128"),
        "exp_avg_sq": parse_state_format("int8_block128"),
    }
    assert o.sqrt_exp_avg_sq and o.v_floor
    x = torch.rand(4, 256)
    held = sum(t.nbytes for s in specs.values() for t in StateCodec(s).encode(x).values())
    assert held / x.numel() == pytest.approx(2 + 8 / 128)
