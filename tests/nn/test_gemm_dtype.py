"""The emulated GEMMs run in bf16 where that is exact (``nn.gemm.gemm_dtype``): operands whose GEMM
parts (``Factored.inner``) are all bf16 numbers (grids of <= 8 significant bits times in-block scales that
keep them so), when the result is bf16. A bf16 result with no outer scale comes straight from a bf16 GEMM;
fp32 tensor / per-row scales (fp8 tensorwise) and NVFP4's tensor scale multiply an fp32-accumulated bf16
GEMM (``kernels.mm_fp32_accumulate``) before the one rounding. fp32 results: fp32 GEMMs of the cast values."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from low_bits_training.formats import factored_quantize, fake_quantize
from low_bits_training.nn import ROLES, LinearPlan, kernels
from low_bits_training.nn.functional import quant_linear
from low_bits_training.nn.gemm import GEMM_OPERANDS, gemm_dtype

EXPECTED = {  # recipe -> GEMM of the (forward, dgrad, wgrad) products with bf16 activations and weights
    "fp8_rowwise": ("bf16", "bf16", "bf16"),
    "mxfp8": ("bf16", "bf16", "bf16"),
    "mxfp4": ("bf16", "bf16", "bf16"),
    "fp8_rowwise_hp_wgrad": ("bf16", "bf16", "bf16"),  # power-of-two scales; wgrad: the bf16 tensors
    "fp8_tensorwise": ("bf16>fp32", "bf16>fp32", "bf16>fp32"),  # fp32 tensor scales after the GEMM
    "nvfp4": ("bf16>fp32", "bf16>fp32", "bf16>fp32"),  # ue4m3 block scales inside, fp32 tensor scale after
}
NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


class _MatmulDtypes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.seen.append(NAMES[args[0].dtype])
        if func is torch.ops.lbt.mm_fp32_accumulate.default:  # the mm inside it runs below this mode
            self.seen.append("bf16>fp32")
        return func(*args, **(kwargs or {}))


def _operands(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-4, 2, 128)  # wide column range
    w = torch.randn(96, 128, generator=g) * 0.05
    dy = torch.randn(64, 96, generator=g) * 1e-3
    return x.to(dtype), w.to(dtype), dy.to(dtype)


@pytest.mark.parametrize("recipe", list(EXPECTED))
def test_each_gemm_runs_in_the_dtype_the_rule_gives(recipe):
    plan = LinearPlan.from_recipe(recipe)
    x, w, dy = _operands(torch.bfloat16)
    dtypes = {"input": x.dtype, "weight": w.dtype, "grad_output": dy.dtype}
    rule = tuple(
        NAMES[gemm_dtype(g, dtypes, plan.specs[op.a], plan.specs[op.b])] for g, op in GEMM_OPERANDS.items()
    )
    assert rule == tuple(e[:4] for e in EXPECTED[recipe])  # "bf16>fp32" multiplies in bf16 too
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    with _MatmulDtypes() as mode:
        y = quant_linear(xr, wr, None, plan)
        y.backward(dy)
    assert tuple(mode.seen) == EXPECTED[recipe]  # forward, then dgrad, then wgrad
    assert y.dtype == xr.grad.dtype == wr.grad.dtype == torch.bfloat16
    x32, w32 = x.float(), w.float()  # fp32 results: the fp32 GEMM of the cast values
    fp32 = {"input": torch.float32, "weight": torch.float32}
    assert gemm_dtype("forward", fp32, plan.specs[0], plan.specs[1]) == torch.float32
    with _MatmulDtypes() as mode:
        quant_linear(x32, w32, None, plan)
    assert mode.seen == ["fp32"]


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "mxfp8", "mxfp4", "fp8_tensorwise", "nvfp4"])
def test_gemm_parts_of_casts_are_bf16_numbers(recipe):
    # The premise of the bf16 GEMM: every GEMM part of a cast survives a round trip through bf16 unchanged
    # (for power-of-two scales the whole cast; for NVFP4 the elements times their ue4m3 block scales).
    x, w, dy = _operands(torch.bfloat16, seed=1)
    natural = {"input": x, "weight": w, "grad_output": dy}
    for role, spec in zip(ROLES, LinearPlan.from_recipe(recipe).specs, strict=True):
        t = natural[role.operand].float()
        f = factored_quantize(t, spec, torch.Generator().manual_seed(3))  # plan specs carry the role's axis
        assert torch.equal(f.inner.bfloat16().float(), f.inner), role.name
        assert torch.equal(f.value(), fake_quantize(t, spec, torch.Generator().manual_seed(3))), role.name
        assert (f.outer is None) == (recipe not in ("fp8_tensorwise", "nvfp4")), role.name


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "mxfp8", "fp8_tensorwise", "nvfp4"])
def test_bf16_gemm_is_the_exact_product_rounded_once(recipe):
    # bf16 GEMM (fp32 accumulation, outer scales on the fp32 result, one rounding) against the float64
    # product of the exact values of the same casts: within half a bf16 ulp plus the fp32 accumulation
    # error, everywhere.
    plan = LinearPlan.from_recipe(recipe)
    x, w, _ = _operands(torch.bfloat16, seed=2)
    y = quant_linear(x, w, None, plan).double()

    def exact(t, spec):
        f = factored_quantize(t.float(), spec)
        return f.inner.double() * (1.0 if f.outer is None else f.outer.double())

    ref = exact(x, plan.specs[0]) @ exact(w, plan.specs[1]).t()
    assert ((y - ref).abs() <= 2.0**-8 * ref.abs() + 1e-6 * ref.abs().max()).all()


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "expected"),
    [(True, True, "amx"), (False, True, "avx512_bf16"), (False, False, "none")],
)
def test_cpu_bf16_gemm_names_the_units_the_cpu_reports(monkeypatch, amx, avx512_bf16, expected):
    from low_bits_training.nn import kernels

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
    assert kernels.cpu_bf16_gemm() == expected
    assert f"bf16 GEMM units: {expected}," in kernels.machine_line()


def test_the_cuda_gemm_multiplies_bf16_operands_into_an_fp32_result():
    """On CUDA ``mm_fp32_accumulate`` is a bf16 tensor-core GEMM with an fp32 result; checked on the meta
    device, where ``aten::mm.dtype`` is registered as on CUDA (no GPU runs in the tests)."""
    seen = []

    class _Calls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((func, tuple(a.dtype for a in args if isinstance(a, torch.Tensor))))
            return func(*args, **(kwargs or {}))

    a, b = torch.empty(64, 128, device="meta"), torch.empty(128, 96, device="meta")
    with _Calls():
        y = kernels.tensor_core_mm(a, b)
    assert (y.shape, y.dtype) == ((64, 96), torch.float32)
    mms = [(func, dtypes) for func, dtypes in seen if func.overloadpacket is torch.ops.aten.mm]
    assert mms == [(torch.ops.aten.mm.dtype, (torch.bfloat16, torch.bfloat16))]  # mm.dtype: out_dtype given
    x = _operands(torch.bfloat16)[0].float()  # the op's precondition: bf16 numbers survive the conversion
    assert torch.equal(x.bfloat16().float(), x)
