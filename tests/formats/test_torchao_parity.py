"""Where the formats core and torchao's casts agree, where they differ on purpose, and the options that match.

Oracles are torchao 0.18's own reference casts (``to_mx``, ``nvfp4_quantize``, Float8 ``hp_tensor_to_float8_dynamic``).
"""

import pytest
import torch

from low_bits_training.formats import QuantSpec, fake_quantize, quantize

torchao = pytest.importorskip("torchao")


def _ao_mx_exponents(x: torch.Tensor, mode: str) -> torch.Tensor:
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    scale, _ = to_mx(x, torch.float8_e4m3fn, 32, ScaleCalculationMode(mode))
    return scale.view(torch.uint8).to(torch.int32).flatten() - 127


def test_rceil_scale_of_near_zero_blocks_is_two_to_minus_127():
    # amax / 448 runs from well below 2**-127 (fp32 subnormal quotients) up into the normal range; the rule is
    # scale = 2**clamp(ceil(log2(amax / 448)), -127, 127), so every quotient <= 2**-127 gives 2**-127.
    exps = torch.arange(-150, -110, dtype=torch.float64)
    amax = torch.cat([torch.exp2(exps) * 448, torch.exp2(exps) * 448 * 1.5]).to(torch.float32)
    amax = amax[amax > 0]
    x = amax[:, None].expand(-1, 32).contiguous()
    ours = torch.log2(quantize(x, QuantSpec.mxfp8("e4m3", "rceil")).scales.flatten()).to(torch.int32)
    want = torch.ceil(torch.log2(amax.double() / 448)).clamp(-127, 127).to(torch.int32)
    assert torch.equal(ours, want)
    assert torch.equal(ours, _ao_mx_exponents(x, "rceil"))
    assert (ours == -127).sum() > 20  # the near-zero blocks the old rule stored as 2**-126


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_mx_scales_equal_torchao_over_a_wide_range(mode):
    torch.manual_seed(0)
    x = (torch.randn(256, 8, 32) * torch.exp2(torch.randint(-140, 120, (256, 8, 1)).float())).reshape(
        256, 256
    )
    ours = torch.log2(quantize(x, QuantSpec.mxfp8("e4m3", mode)).scales.flatten()).to(torch.int32)
    assert torch.equal(ours, _ao_mx_exponents(x, mode))


def _ao_nvfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    ts = per_tensor_amax_to_scale(x.abs().max())
    scales, packed = nvfp4_quantize(x, 16, ts)
    vals = f4_unpacked_to_f32(unpack_uint4(packed)).reshape(x.shape[0], -1, 16)
    # element x block scale (exact) x tensor scale, as we dequantize (torchao's dequantize multiplies by
    # tensor x block scale first: the last fp32 bit may differ)
    values = vals * scales.float().reshape(x.shape[0], -1, 1) * ts
    return scales.float().flatten(), values.reshape(x.shape)


def test_nvfp4_block_scales_subnormal_vs_torchao_normal_floor():
    # Rows spanning 2**-16 .. 1 of the tensor amax: blocks far below the tensor amax want ue4m3 scales under
    # 2**-6, which we keep (subnormal, down to 2**-9) and torchao clamps up to 2**-6.
    torch.manual_seed(0)
    x = torch.randn(512, 1024) * torch.exp2(-16 * torch.rand(512, 1))
    ao_scales, ao_values = _ao_nvfp4(x)
    ours = quantize(x, QuantSpec.nvfp4()).scales.flatten()
    differ = ours != ao_scales
    assert 0.05 < differ.float().mean() < 0.2  # 10.2% of blocks with this seed (docs/formats.md)
    assert (ours[differ] < 2**-6).all() and (ao_scales[differ] == 2**-6).all()
    matched = QuantSpec.nvfp4(scale_min="normal")
    assert torch.equal(quantize(x, matched).scales.flatten(), ao_scales)
    # Same scales; elements agree but for rare near-ties: torchao multiplies by the reciprocal scale, we
    # divide by the scale (1 element of 524288 with this seed; 0 with seeds 1-4).
    assert (fake_quantize(x, matched) != ao_values).sum() <= 2


def _ao_fp8(x: torch.Tensor, rowwise: bool) -> torch.Tensor:
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig

    gran = ScalingGranularity.AXISWISE if rowwise else ScalingGranularity.TENSORWISE
    t = hp_tensor_to_float8_dynamic(
        x,
        torch.float8_e4m3fn,
        LinearMMConfig(),
        gemm_input_role=GemmInputRole.INPUT,
        scaling_granularity=gran,
        axiswise_dim=-1,
        round_scales_to_power_of_2=rowwise,
    )
    return t.to_original_precision()


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_fp8_with_one_inf_keep_vs_torchao_nan(rowwise):
    torch.manual_seed(0)
    x = torch.randn(4, 32)
    x[1, 2] = float("inf")
    spec = QuantSpec.fp8_rowwise(scale_rounding="rceil") if rowwise else QuantSpec.fp8_tensorwise()
    group = x[1:2] if rowwise else x
    kept = fake_quantize(x, spec)
    kept_group = kept[1:2] if rowwise else kept
    assert kept_group.isinf().sum() == 1 and (kept_group == 0).sum() == group.numel() - 1
    ao = _ao_fp8(x, rowwise)
    ao_group = ao[1:2] if rowwise else ao
    assert ao_group.isnan().all()
    nan_spec = QuantSpec(**{**spec.__dict__, "inf_amax": "nan"})
    assert torch.equal(fake_quantize(x, nan_spec).isnan(), ao.isnan())
    if rowwise:  # the finite rows are untouched either way, and equal torchao's bit for bit
        assert torch.equal(fake_quantize(x, nan_spec)[[0, 2, 3]], ao[[0, 2, 3]])


def test_short_labels_name_the_torchao_options():
    assert QuantSpec.nvfp4(scale_min="normal").short() == "e2m1/block16(ue4m3,exact+t32,minN)/rne"
    assert QuantSpec.fp8_tensorwise(inf_amax="nan").short() == "e4m3/tensor(fp32,exact,infNaN)/rne"
    with pytest.raises(ValueError, match="QuantSpec.inf_amax='zero' is not one of"):
        QuantSpec("e4m3", inf_amax="zero")
