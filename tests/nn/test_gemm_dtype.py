"""The emulated GEMMs run in bf16 where that is exact (``nn.functional.gemm_dtype``): bf16 results from
operands whose cast values are all bf16 numbers (grids of <= 8 significant bits, power-of-two scales)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from low_bits_training.formats import fake_quantize
from low_bits_training.nn import ROLES, LinearPlan
from low_bits_training.nn.functional import GEMM_OPERANDS, gemm_dtype, quant_linear

EXPECTED = {  # recipe -> dtype of the (forward, dgrad, wgrad) GEMMs with bf16 activations and weights
    "fp8_rowwise": ("bf16", "bf16", "bf16"),
    "mxfp8": ("bf16", "bf16", "bf16"),
    "mxfp4": ("bf16", "bf16", "bf16"),
    "fp8_rowwise_hp_wgrad": ("bf16", "bf16", "bf16"),  # power-of-two scales; wgrad: the bf16 tensors
    "fp8_tensorwise": ("fp32", "fp32", "fp32"),  # fp32 scales
    "nvfp4": ("fp32", "fp32", "fp32"),  # ue4m3 block scales under an fp32 tensor scale
}
NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32"}


class _MatmulDtypes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            self.seen.append(NAMES[args[0].dtype])
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
    tensors = {"input": x, "weight": w, "grad_output": dy}
    rule = tuple(
        NAMES[gemm_dtype(g, tensors, plan.specs[op.a], plan.specs[op.b])] for g, op in GEMM_OPERANDS.items()
    )
    assert rule == EXPECTED[recipe]
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    with _MatmulDtypes() as mode:
        y = quant_linear(xr, wr, None, plan)
        y.backward(dy)
    assert tuple(mode.seen) == EXPECTED[recipe]  # forward, then dgrad, then wgrad
    assert y.dtype == xr.grad.dtype == wr.grad.dtype == torch.bfloat16
    x32, w32, dy32 = (t.float() for t in (x, w, dy))
    assert gemm_dtype("forward", {"input": x32, "weight": w32}, plan.specs[0], plan.specs[1]) == torch.float32


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "mxfp8", "mxfp4"])
def test_power_of_two_scaled_casts_are_bf16_numbers(recipe):
    # The premise of the bf16 GEMM: every cast value survives a round trip through bf16 unchanged.
    x, w, dy = _operands(torch.bfloat16, seed=1)
    natural = {"input": x, "weight": w, "grad_output": dy}
    for role, spec in zip(ROLES, LinearPlan.from_recipe(recipe).specs, strict=True):
        q = fake_quantize(natural[role.operand].float(), spec)  # plan specs carry the role's axis
        assert torch.equal(q.bfloat16().float(), q), role.name


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "mxfp8"])
def test_bf16_gemm_is_the_exact_product_rounded_once(recipe):
    # bf16 GEMM (fp32 accumulation, one rounding) against the float64 product of the same casts: within
    # half a bf16 ulp plus the fp32 accumulation error, everywhere.
    plan = LinearPlan.from_recipe(recipe)
    x, w, _ = _operands(torch.bfloat16, seed=2)
    y = quant_linear(x, w, None, plan).double()
    xq = fake_quantize(x.float(), plan.specs[0]).double()
    wq = fake_quantize(w.float(), plan.specs[1]).double()
    ref = xq @ wq.t()
    assert ((y - ref).abs() <= 2.0**-8 * ref.abs() + 1e-6 * ref.abs().max()).all()
