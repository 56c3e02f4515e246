"""Scaling: torchao's MX emulation bit for bit, grouping semantics, zero / NaN groups, shape errors."""

from __future__ import annotations

import math

import pytest
import torch
from formats_helpers import assert_same_bits

from low_bits_training.formats import (
    QuantSpec,
    check_divisible,
    compute_scales,
    fake_quantize,
    get_format,
    group_scales,
    grouped_shape,
    round_to,
)

MX_ELEMS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m3": "fp6_e2m3", "e3m2": "fp6_e3m2",
            "e2m1": torch.float4_e2m1fn_x2}  # fmt: skip


def _mx_input(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """(64, 256) values whose 1x32 blocks span 2**-40 .. 2**40, with an all-zero block, a block with one
    nonzero, exact powers of two (the floor/ceil boundary) and values just above them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 256, generator=g) * torch.exp2(
        torch.randint(-40, 40, (64, 8, 1), generator=g)
    ).repeat_interleave(32, 1).squeeze(-1)
    x[0, :32] = 0.0
    x[1, :32] = 0.0
    x[1, 5] = -3.0
    x[2, :32] = 448.0
    x[3, :32] = torch.nextafter(torch.tensor(448.0), torch.tensor(1e9))
    x[4, :64] = torch.exp2(torch.arange(64.0) - 30)
    return x.to(dtype)


def _torchao_mx(x: torch.Tensor, elem: str, mode: str) -> torch.Tensor:
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    scale, data = to_mx(x, MX_ELEMS[elem], 32, getattr(ScaleCalculationMode, mode.upper()))
    return to_dtype(data, scale, MX_ELEMS[elem], 32, x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["floor", "rceil", "ceil"])
@pytest.mark.parametrize("elem", list(MX_ELEMS))
def test_mx_matches_torchao_to_mx(elem, mode, dtype):
    x = _mx_input(dtype)
    got = fake_quantize(x, QuantSpec.mxfp8(elem, scale_rounding=mode))
    assert got.dtype == dtype
    assert_same_bits(got, _torchao_mx(x, elem, mode), f"mx {elem} {mode} {dtype}")


def test_mx_nan_block_is_nan_and_zero_block_is_zero():
    x = torch.randn(2, 64)
    x[0, 3] = float("nan")
    x[1, :32] = 0
    y = fake_quantize(x, QuantSpec.mxfp4())
    assert torch.isnan(y[0, :32]).all() and not torch.isnan(y[0, 32:]).any()
    assert (y[1, :32] == 0).all()


ALL_ZERO_SPECS = [QuantSpec.mxfp8(scale_rounding="floor"), QuantSpec.mxfp4(scale_rounding="rceil"), QuantSpec.nvfp4(), QuantSpec.fp8_tensorwise(),
                  QuantSpec.fp8_rowwise(), QuantSpec.deepseek_weight(), QuantSpec.int8_rowwise(),
                  QuantSpec("e4m3", "block", block_size=128, scale_format="e8m0", scale_rounding="exact")]  # fmt: skip


@pytest.mark.parametrize("spec", ALL_ZERO_SPECS, ids=str)
def test_all_zero_tensor_gives_zeros_and_unit_scales(spec):
    x = torch.zeros(128, 256)
    y = fake_quantize(x, spec)
    assert torch.equal(y, x)
    s = compute_scales(x, spec)
    assert torch.isfinite(s).all() and (s == 1).all()


def _loop_reference(x: torch.Tensor, spec: QuantSpec, row_groups: int, col_groups: int) -> torch.Tensor:
    """Group by explicit slicing of a 2-D tensor, one fp32 scale amax/max per group."""
    out = torch.empty_like(x)
    rs, cs = x.shape[0] // row_groups, x.shape[1] // col_groups
    for i in range(row_groups):
        for j in range(col_groups):
            blk = x[i * rs : (i + 1) * rs, j * cs : (j + 1) * cs]
            s = blk.abs().max() / spec.elem.max
            out[i * rs : (i + 1) * rs, j * cs : (j + 1) * cs] = round_to(blk / s, spec.elem) * s
    return out


@pytest.mark.parametrize(
    "spec,groups",
    [
        (QuantSpec.fp8_tensorwise(), (1, 1)),
        (QuantSpec.fp8_rowwise(), (64, 1)),  # axis=-1: one scale per row
        (QuantSpec.fp8_rowwise(axis=0), (1, 256)),  # axis=0: one scale per column
        (QuantSpec.deepseek_act(), (64, 2)),  # 1x128 blocks along the rows
        (QuantSpec("e4m3", "block", axis=0, block_size=32), (2, 256)),  # 32x1 blocks down the columns
        (QuantSpec("e4m3", "tile", block_size=32), (2, 8)),
        (QuantSpec("int4", "tile", block_size=32), (2, 8)),
    ],
    ids=str,
)
def test_grouping_matches_explicit_slicing(spec, groups):
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)) * 3
    assert_same_bits(fake_quantize(x, spec), _loop_reference(x, spec, *groups), str(spec))
    assert compute_scales(x, spec).numel() == groups[0] * groups[1]


def test_block_scales_broadcast_against_grouped_view():
    x = torch.randn(4, 6, 64)
    spec = (
        QuantSpec.mxfp8(axis=1, block_size=3) if False else QuantSpec("e4m3", "block", axis=1, block_size=3)
    )
    gshape, dims = grouped_shape(x.shape, spec)
    assert gshape == (4, 2, 3, 64) and dims == (2,)
    assert compute_scales(x, spec).shape == (4, 2, 1, 64)


def test_nvfp4_two_level_scales():
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    spec = QuantSpec.nvfp4()
    gs = group_scales(x.reshape(32, 4, 16), spec, (2,))
    assert gs.tensor_scale.item() == pytest.approx(x.abs().max().item() / (448 * 6), rel=1e-6)
    assert_same_bits(gs.block_scale, round_to(gs.block_scale, "ue4m3"), "block scales on the ue4m3 grid")
    assert gs.block_scale.max() <= 448
    y = fake_quantize(x, spec)
    assert ((y - x).norm() / x.norm()).item() < 0.2  # 4-bit: SQNR well above 14 dB


def test_scale_rounding_choices_on_one_block():
    x = torch.full((1, 32), 3.0)  # amax 3 = 1.5 * 2**1; e4m3 max 448, emax 8
    scale = lambda **kw: compute_scales(x, QuantSpec("e4m3", "block", scale_format="e8m0", **kw)).item()  # noqa: E731
    assert scale(scale_rounding="floor") == 2.0 ** (1 - 8)  # OCP MX: floor(log2 amax) - emax_elem
    assert scale(scale_rounding="ceil") == 2.0 ** (2 - 8)
    assert scale(scale_rounding="rceil") == 2.0 ** math.ceil(math.log2(3 / 448))
    assert scale(scale_rounding="floor", margin=2) == 2.0 ** (1 - 8 + 2)
    exact = compute_scales(x, QuantSpec("e4m3", "block")).item()
    assert exact == torch.tensor(3.0 / 448, dtype=torch.float32).item()


@pytest.mark.parametrize("scale_format", ["e8m0", "fp32"])
def test_power_of_two_scales_divide_exactly_even_at_the_smallest_scale(scale_format):
    # Power-of-two scales are applied as a multiply by their inverse where that is exact; an fp32-format
    # scale of 2**-149 (tiny amax) has no finite inverse, so such specs must keep the divide.
    spec = QuantSpec("e4m3", "block", scale_format=scale_format, scale_rounding="floor")
    x = torch.randn(4, 64) * torch.tensor([1.0, 2.0**-140, 2.0**-149, 1e30]).reshape(4, 1)
    x[2, :] = 2.0**-149 * torch.randint(-1, 2, (64,))
    x[2, 0] = 2.0**-149
    s = compute_scales(x, spec)
    xg = x.reshape(grouped_shape(x.shape, spec)[0])
    want = (round_to(xg / s, "e4m3") * s).reshape(x.shape)
    assert_same_bits(fake_quantize(x, spec), want, scale_format)


def test_divisibility_error_names_block_size_dim_and_size():
    with pytest.raises(ValueError, match=r"block_size=32 does not divide dim 1 of size 100"):
        check_divisible((8, 100), QuantSpec.mxfp8())
    with pytest.raises(ValueError, match=r"block_size=128 does not divide dim 0 of size 64"):
        fake_quantize(torch.zeros(64, 128), QuantSpec.deepseek_weight())
    check_divisible((8, 100), QuantSpec.fp8_rowwise())  # axis scaling needs no divisibility


@pytest.mark.parametrize(
    "kw,field",
    [
        ({"scaling": "blocks"}, "scaling"),
        ({"scale_format": "e4m3"}, "scale_format"),
        ({"block_size": 0}, "block_size"),
        ({"scale_rounding": "round"}, "scale_rounding"),
        ({"rounding": "up"}, "rounding"),
        ({"margin": 1.5}, "margin"),
    ],  # fmt: skip
)
def test_spec_validation_one_line_errors(kw, field):
    with pytest.raises(ValueError, match=rf"^QuantSpec\.{field}=") as err:
        QuantSpec("e4m3", **kw)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown format"):
        QuantSpec("e4m9x")


def test_spec_short_labels():
    assert QuantSpec.mxfp8().short() == "e4m3/block32(e8m0,rceil)/rne"  # recipe mxfp8's numerics
    assert QuantSpec.mxfp8(scale_rounding="floor").short() == "e4m3/block32(e8m0,floor)/rne"  # OCP's rule
    assert str(QuantSpec.nvfp4()) == "e2m1/block16(ue4m3,exact+t32)/rne"
    assert QuantSpec.deepseek_weight().short() == "e4m3/tile128x128(fp32,exact)/rne"
    assert QuantSpec("int8", "axis", rounding="stochastic").short() == "int8/axis-1(fp32,exact)/sr"
    assert get_format(QuantSpec.mxfp4().format).name == "e2m1"
