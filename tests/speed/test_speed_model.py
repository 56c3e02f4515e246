"""The speed model held to hand-computed cases: one GEMM's time, the bytes of a cast, the step formulas, the
dtype each plan's GEMMs run in per GPU generation."""

import dataclasses

import pytest

from low_bits_training.formats import QuantSpec
from low_bits_training.nn import LinearPlan
from low_bits_training.speed import GPUS, PARAMS, GemmTarget, GpuSpec, SpeedParams, gemm_dtype, gpu, predict
from low_bits_training.speed.casts import tensor_cast
from low_bits_training.speed.gpus import gpu_for_device
from low_bits_training.speed.predict import GemmRow, Prediction, TargetRow

# A round GPU: 1000 TFLOP/s bf16, 2000 fp8, 4000 fp4; 1 TB/s.
ROUND = GpuSpec("round", "sm100", (10, 0), {"bf16": 1000.0, "fp8": 2000.0, "fp4": 4000.0}, 1.0)
IDEAL = SpeedParams(gemm_efficiency=1.0, fp4_efficiency=1.0, kernel_overhead_us=0.0, cast_bandwidth=1.0, nongemm_share=0.0)  # fmt: skip


def recipe(name: str) -> LinearPlan:
    return LinearPlan.from_recipe(name)


def test_one_bf16_gemm_takes_its_flops_at_peak_plus_its_bytes_at_bandwidth():
    m = k = n = 1024
    pred = predict([GemmTarget("w", k, n, m)], ROUND, IDEAL)
    forward = pred.rows[0].gemms[0]
    flops = 2 * 1024**3  # 2 M K N
    io = (m * k + n * k + m * n) * 2  # x, W read and y written, bf16
    assert forward.flops == flops
    assert forward.seconds == pytest.approx(flops / 1e15 + io / 1e12, rel=1e-12)
    assert forward.dtype == "bf16" and pred.gemm_speedup == 1.0 and pred.speedup == 1.0


def test_the_documented_parameters_on_an_h100():
    # 4096^3 in bf16 on an H100: flops / (0.70 x 989.4 TFLOP/s) + 3 x 4096^2 x 2 B / 3.35 TB/s + 3 us.
    pred = predict([GemmTarget("w", 4096, 4096, 4096)], gpu("H100"))
    expected = 2 * 4096**3 / (0.70 * 989.4e12) + 3 * 4096**2 * 2 / 3.35e12 + 3e-6
    assert pred.rows[0].gemms[0].seconds == pytest.approx(expected, rel=1e-12)


def test_an_fp4_gemm_runs_at_its_peak_times_the_fp4_efficiency():
    params = dataclasses.replace(IDEAL, fp4_efficiency=0.5)
    target = GemmTarget("w", 4096, 4096, 4096, recipe("nvfp4"))
    forward = predict([target], ROUND, params).rows[0].gemms[0]
    io = (2 * 4096**2) * 0.5 + 4096**2 * 2  # e2m1 operands, bf16 output
    assert forward.dtype == "fp4"
    assert forward.seconds == pytest.approx(2 * 4096**3 / (0.5 * 4e15) + io / 1e12, rel=1e-12)


def _cast(tensor, plan, elems, lowp=True, m=2048, k=4096, n=1024):
    specs = dict(zip((f"{r.gemm}.{r.operand}" for r in _roles()), plan.specs, strict=True))
    contraction = {"forward": k, "dgrad": n, "wgrad": m}
    return tensor_cast(
        tensor, elems, specs, dict.fromkeys(contraction, lowp), contraction, dict.fromkeys(contraction, 1.0)
    )


def _roles():
    from low_bits_training.nn.roles import ROLES

    return ROLES


def test_mxfp8_weight_is_cast_twice_one_byte_an_element_plus_one_e8m0_scale_per_32():
    kn = 4096 * 1024
    cost = _cast("weight", recipe("mxfp8"), kn)
    # forward (blocks along K) and dgrad (along N) are two casts: each reads bf16 and writes K*N + K*N/32
    assert cost.bytes == 2 * (kn * 2) + 2 * (kn * 1 + kn / 32)
    assert cost.kernels == 2


def test_tensorwise_casts_once_for_both_gemms_after_an_amax_pass():
    elems = 2048 * 4096
    cost = _cast("input", recipe("fp8_tensorwise"), elems)
    # one read for the cast (both layouts written), one read for the amax
    assert cost.bytes == elems * 2 + 2 * elems * 1 + elems * 2
    assert cost.kernels == 2
    delayed = _cast("input", recipe("fp8_delayed"), elems)  # the amax comes from the history
    assert delayed.bytes == elems * 2 + 2 * elems * 1 and delayed.kernels == 1


def test_nvfp4_weight_tiles_serve_both_gemms_half_a_byte_and_one_ue4m3_per_16x16():
    kn = 4096 * 1024
    cost = _cast("weight", recipe("nvfp4"), kn)
    writes = 2 * (kn * 0.5 + kn / 256 + 4)  # + the fp32 tensor scale
    assert cost.bytes == kn * 2 + writes + kn * 2  # one cast read, one amax read
    assert cost.kernels == 2


def test_rowwise_fp32_scales_are_four_bytes_a_row_along_each_gemms_contraction():
    m, k = 2048, 4096
    cost = _cast("input", recipe("fp8_rowwise"), m * k, m=m, k=k)
    # forward: M rows of K (M scales); wgrad: K rows of M (K scales)
    assert cost.bytes == 2 * (m * k * 2) + 2 * m * k + 4 * m + 4 * k


def test_a_role_whose_gemm_has_no_kernel_is_fake_quantized_to_bf16():
    elems = 1024 * 1024
    cost = _cast("grad_output", recipe("mxfp8"), elems, lowp=False)
    assert cost.bytes == 2 * (elems * 2) + 2 * (elems * 2)  # read bf16, write bf16, twice (no scales kept)


def test_step_speedup_and_amdahl_ceiling():
    # G_bf16 = 1, G = 0.5, C = 0.1, s = 0.3: T_bf16 = 1 / 0.7, T = 0.6 + 0.3 / 0.7
    target = GemmTarget("w", 1, 1, 1)
    rows = (TargetRow(target, (GemmRow("forward", "fp8", 1.0, 0.5, 1.0),), 0.0, 0.1),)
    pred = Prediction("x", rows, dataclasses.replace(PARAMS, nongemm_share=0.3))
    assert pred.bf16_step_seconds == pytest.approx(1 / 0.7)
    assert pred.speedup == pytest.approx(10 / 7.2)  # (1/0.7) / (0.6 + 0.3/0.7)
    assert pred.ceiling == pytest.approx(10 / 6.5)  # casts free: (1/0.7) / (0.5 + 0.3/0.7)
    assert pred.gemm_speedup == pytest.approx(1 / 0.6)


@pytest.mark.parametrize(
    ("name", "gpu_name", "dtypes"),
    [
        ("mxfp8", "H100", ("bf16", "bf16", "bf16")),  # no MX kernels on Hopper
        ("mxfp8", "B200", ("fp8", "fp8", "fp8")),
        ("nvfp4", "B200", ("fp4", "fp4", "fp4")),
        ("nvfp4", "H200", ("bf16", "bf16", "bf16")),
        ("mxfp6", "B300", ("fp6", "fp6", "fp6")),
        ("fp8_rowwise", "H100", ("fp8", "fp8", "fp8")),
        ("fp8_rowwise_hp_wgrad", "H100", ("fp8", "fp8", "bf16")),
        ("deepseek_fp8", "H100", ("fp8", "fp8", "fp8")),
        ("fp8_rowwise_2d_weights", "H100", ("fp8", "fp8", "fp8")),  # row scales ride along 128-blocks
        ("int8", "H100", ("int8", "int8", "int8")),
        ("bf16", "B200", ("bf16", "bf16", "bf16")),
    ],
)
def test_gemm_dtype_per_recipe_and_gpu(name, gpu_name, dtypes):
    plan = recipe(name)
    got = tuple(
        gemm_dtype(plan.spec(f"{g}.{a}"), plan.spec(f"{g}.{b}"), gpu(gpu_name))
        for g, a, b in _gemm_operands()
    )
    assert got == dtypes


def _gemm_operands():
    return [
        ("forward", "input", "weight"),
        ("dgrad", "grad_output", "weight"),
        ("wgrad", "grad_output", "input"),
    ]


def test_mixed_mx_widths_run_at_the_fp8_rate_and_unknown_formats_in_bf16():
    b200 = gpu("B200")
    assert gemm_dtype(QuantSpec.mxfp8(), QuantSpec.mxfp4(), b200) == "fp8"
    assert gemm_dtype(QuantSpec("e3m4", "tensor"), QuantSpec.fp8_tensorwise(), b200) == "bf16"
    assert gemm_dtype(QuantSpec.mxfp8(), None, b200) == "bf16"
    assert gemm_dtype(QuantSpec.nvfp4(), QuantSpec.mxfp8(), b200) == "bf16"  # two scale families


def test_attention_probabilities_stay_on_chip_and_fp8_all_gather_shares_the_weight_cast():
    qk = GemmTarget("a.qk", 128, 4096, 4096, kind="qk", count=64)
    assert qk.elems("grad_output") == 0 and qk.elems("input") == 4096 * 128 * 64
    w = GemmTarget("w", 4096, 4096, 8192, recipe("fp8_tensorwise"), weight_share=1 / 8)
    assert w.elems("weight") == 4096 * 4096 / 8


def test_gpu_table_names_and_device_names():
    assert set(GPUS) >= {"H100", "H200", "B200", "GB200", "B300", "GB300"}
    assert gpu("b200") is GPUS["B200"]
    with pytest.raises(ValueError, match="unknown GPU 'A100': expected one of H100"):
        gpu("A100")
    assert gpu_for_device("NVIDIA H100 80GB HBM3") is GPUS["H100"]
    assert gpu_for_device("NVIDIA GB200") is GPUS["GB200"] and gpu_for_device("NVIDIA B200") is GPUS["B200"]
    assert gpu_for_device("NVIDIA H200 NVL") is GPUS["H200-NVL"] and gpu_for_device("NVIDIA A100") is None
    assert GPUS["B200"].hardware().capability == (10, 0) and GPUS["H200"].hardware().capability == (9, 0)


def test_bad_parameters_and_no_targets_are_refused():
    with pytest.raises(ValueError, match="nongemm_share=1.0"):
        SpeedParams(nongemm_share=1.0)
    with pytest.raises(ValueError, match="gemm_efficiency=0"):
        SpeedParams(gemm_efficiency=0)
    with pytest.raises(ValueError, match="no GEMM targets"):
        predict([], gpu("H100"))


# --- what this package runs (issue 37 items 5 and 10) -----------------------------------------------------


def test_emulated_gemms_multiply_in_bf16_where_exact_else_fp32():
    from low_bits_training.speed.model import emulated_gemm_dtype

    mx, ds = recipe("mxfp8"), recipe("deepseek_fp8")
    assert emulated_gemm_dtype(mx.spec("forward.input"), mx.spec("forward.weight"), "emulate") == "bf16"
    nv = recipe("nvfp4")  # e2m1 x ue4m3 blocks: 2 + 4 significant bits; the fp32 tensor scale goes outside
    assert emulated_gemm_dtype(nv.spec("forward.input"), nv.spec("forward.weight"), "emulate") == "bf16"
    # exact fp32 128-block scales: an e4m3 value times such a scale is no bf16 number
    assert emulated_gemm_dtype(ds.spec("forward.input"), ds.spec("forward.weight"), "emulate") == "fp32"
    assert emulated_gemm_dtype(mx.spec("forward.input"), None, "torchao_emulated") == "fp32"


def test_as_run_prices_an_emulated_gemm_at_its_emulation_dtype_not_the_kernels():
    m = k = n = 4096
    ds = GemmTarget("w", k, n, m, recipe("deepseek_fp8"))  # backends: ("emulate",) * 3
    h100 = gpu("H100")
    kernels, ours = predict([ds], h100, IDEAL), predict([ds], h100, IDEAL, as_run=True)
    assert [g.dtype for g in kernels.rows[0].gemms] == ["fp8"] * 3  # DeepGEMM's 128-blocks run on SM90
    assert [g.dtype for g in ours.rows[0].gemms] == ["fp32"] * 3
    flops, io = 2 * m * k * n, (m * k + n * k) * 4 + m * n * 2  # forward: x, W read in fp32, y in bf16
    assert ours.rows[0].gemms[0].seconds == pytest.approx(flops / 67e12 + io / 3.35e12, rel=1e-12)
    assert ours.speedup < 0.1 < 1.0 < kernels.speedup
    # an emulated plan the GPU has no kernel for is priced the same either way (mxfp8 on an H100)
    mx = GemmTarget("w", k, n, m, recipe("mxfp8"))
    assert predict([mx], h100, as_run=True).speedup == predict([mx], h100).speedup
    # a plan resolved to torchao's kernel is a kernel's figure in both
    fp8 = dataclasses.replace(recipe("fp8_rowwise"), backends=("torchao",) * 3)
    torchao = GemmTarget("w", k, n, m, fp8)
    assert predict([torchao], h100, as_run=True).speedup == predict([torchao], h100).speedup > 1.0


def test_nvfp4_torchao_routed_to_torchao_on_a_b200_is_priced_at_the_fp4_rate():
    # resolved on a B200 the plan runs torchao's NVFP4Linear: fp4 tensor cores (nv16 scales); emulated (an H100,
    # or backend "emulate") the same plan is priced at its emulation's dtype
    m = k = n = 4096
    b200 = gpu("B200")
    plan = recipe("nvfp4_torchao")
    routed = GemmTarget("w", k, n, m, dataclasses.replace(plan, backends=("torchao",) * 3))
    ours = GemmTarget("w", k, n, m, plan)  # backends ("emulate",) * 3
    fast, slow = predict([routed], b200, IDEAL, as_run=True), predict([ours], b200, IDEAL, as_run=True)
    assert [g.dtype for g in fast.rows[0].gemms] == ["fp4"] * 3
    assert [g.dtype for g in slow.rows[0].gemms] != ["fp4"] * 3
    flops = 2 * m * k * n
    assert fast.rows[0].gemms[0].seconds >= flops / (
        b200.peaks["fp4"] * 1e12
    )  # at most the fp4 peak (TFLOPS)
    assert fast.speedup > 1.0 > slow.speedup
    assert fast.speedup == predict([routed], b200, IDEAL).speedup  # the kernels' figure: what runs
