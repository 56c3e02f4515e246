"""The real fp8 kernel (``torch._scaled_mm``, CPU here) against the emulation, and against torch's own casts.

Stated bound: on CPU the real and emulated GEMMs agree bit for bit (forward, grad_input, grad_weight; fp32
and bf16 inputs) wherever the scales are powers of two (rowwise rceil recipes, tensorwise with rceil). With
fp32 tensor scales: fp32 inputs, the e4m3 x e4m3 forward GEMM differs in the last bit (within 4e-7 of the
largest output; the CPU kernel applies the scales in another order), grad_input and grad_weight stay bit for
bit; bf16 inputs, all three differ by at most one bf16 ulp (or 1e-6 of the largest output, where sums
cancel) on < 0.1% of the elements (the emulation multiplies the fp32 accumulation by the two scales, as a
GPU kernel's epilogue does, ``nn.gemm.product``; torch's CPU kernel scales the operands first).
bf16 inputs with power-of-two scales: the emulation's GEMM is oneDNN's bf16 kernel, whose fp32 sums run in
the kernel's own order: bit for bit with ``_scaled_mm`` on CPUs with AMX, the same one-ulp bound without
(one element of 61440 differed by one bf16 ulp on an AVX512-BF16 Xeon without AMX).
"""

import dataclasses

import pytest
import torch
from nn_helpers import linear_grads, operands, plan_for

from low_bits_training.formats import QuantSpec
from low_bits_training.nn import LinearPlan, kernels


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "recipe", ["fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_hp_wgrad", "fp8_tensorwise_rceil"]
)
def test_real_equals_emulate(recipe, dtype):
    plan = plan_for(recipe.removesuffix("_rceil"))
    if recipe.endswith("_rceil"):  # power-of-two tensor scales
        plan = LinearPlan(
            tuple(dataclasses.replace(s, scale_rounding="rceil") for s in plan.specs), plan.backends
        )
    real_plan = LinearPlan(plan.specs, ("real",) * 3)
    for seed in range(2):
        x, w, dy = operands(m=192, k=320, n=256, dtype=dtype, seed=seed)
        emu, real = linear_grads(x, w, dy, plan), linear_grads(x, w, dy, real_plan)
        for name, a, b in zip(("output", "grad_input", "grad_weight"), real, emu, strict=True):
            if dtype == torch.bfloat16 and (recipe == "fp8_tensorwise" or kernels.cpu_bf16_gemm() != "amx"):
                a, b = a.float(), b.float()
                bound = 2.0**-7 * torch.maximum(a.abs(), b.abs()) + 1e-6 * b.abs().max()  # + cancellation
                assert ((a - b).abs() <= bound).all(), f"{recipe} {dtype} {name}"
                assert (a != b).float().mean() < 1e-3, f"{recipe} {dtype} {name}"
                continue
            if recipe == "fp8_tensorwise" and name == "output":
                # e4m3 x e4m3 with fp32 (not power-of-two) scales: the CPU kernel applies the two scales in
                # another order than the emulation's (q_a s_a)(q_b s_b) products: last-bit differences.
                rel = ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                assert rel < (4e-7 if dtype == torch.float32 else 1e-3), f"{recipe} {dtype} {name}: {rel}"
                assert (a != b).float().mean() < (1.0 if dtype == torch.float32 else 1e-3)
                continue
            assert torch.equal(a, b), f"{recipe} {dtype} {name}: max diff {(a - b).abs().max()}"


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_scaled_mm_matches_torch_casts(fmt):
    # Outside oracle: rowwise power-of-two scales, torch's own float8 cast of x/scale, then _scaled_mm.
    x, w, _ = operands(m=64, k=96, n=48)
    sx = QuantSpec(fmt, "axis", axis=-1, scale_rounding="rceil")
    sw = QuantSpec("e4m3", "axis", axis=-1, scale_rounding="rceil")
    got = kernels.scaled_mm(x, sx, False, (), w, sw, True, ())
    ax = x.abs().amax(1, keepdim=True) / (57344.0 if fmt == "e5m2" else 448.0)
    aw = w.abs().amax(1, keepdim=True) / 448.0
    scale_x, scale_w = torch.exp2(torch.ceil(torch.log2(ax))), torch.exp2(torch.ceil(torch.log2(aw)))
    qx = (x / scale_x).to(kernels.FP8_DTYPES[fmt])
    qw = (w / scale_w).to(torch.float8_e4m3fn)
    want = torch._scaled_mm(qx, qw.t(), scale_x, scale_w.t().contiguous(), out_dtype=torch.float32)
    assert torch.equal(got, want)


def test_unsupported_reasons():
    e4 = QuantSpec("e4m3", "axis")
    assert kernels.unsupported_reason(e4, QuantSpec("e5m2", "tensor")) is None
    assert "e5m2 x e5m2" in kernels.unsupported_reason(QuantSpec("e5m2"), QuantSpec("e5m2"))
    assert "not e4m3/e5m2" in kernels.unsupported_reason(e4, QuantSpec.mxfp4())
    assert "tensorwise/rowwise" in kernels.unsupported_reason(e4, QuantSpec.mxfp8())
    assert "high precision" in kernels.unsupported_reason(e4, None)
