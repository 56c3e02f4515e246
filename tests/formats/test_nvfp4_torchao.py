"""The ``nvfp4_torchao`` recipe and its options (issue 38): NVFP4 as torchao 0.18's training module computes it.

torchao's ``NVFP4TrainingConfig`` runs Triton kernels only (CUDA): its scale arithmetic (``_nvfp4_quantize``,
``_nvfp4_2d_quantize``) does not run here. ``ao_reference`` below is that arithmetic written again from the
kernels' source, step by step in fp32 torch, with torchao's own CPU pieces where they exist: its RHT matrix
(``get_rht_matrix``), its e2m1 cast (``f32_to_f4_unpacked`` / ``f4_unpacked_to_f32``, which the kernels' PTX
``cvt.rn.satfinite`` stands for) and its tensor scale (``per_tensor_amax_to_scale``). Where a torchao function
computing NVFP4 runs on the CPU (``NVFP4Tensor.to_nvfp4`` with one level of scales) our cast equals it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torchao.prototype.moe_training.nvfp4_training.hadamard_utils import get_rht_matrix
from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked
from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

from low_bits_training.config.quantize import QuantizeConfig, QuantRule
from low_bits_training.formats import QuantSpec, fake_quantize
from low_bits_training.formats.hadamard import operand_rht, rht, sign_vector
from low_bits_training.nn import LinearPlan, QuantLinear
from low_bits_training.nn.recipes import RECIPES, recipe_specs
from low_bits_training.plan.resolve import LayerShape, resolve_plan

AO_OPTIONS = dict(scale_apply="reciprocal", scale_min="normal", scale_order="torchao")
OURS = dict(
    scale_apply="divide", scale_min="subnormal", scale_order="decode", rht_signs="seeded", rht_output="fp32"
)
TE_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
SPEC = QuantSpec.nvfp4(**AO_OPTIONS)
TILE = QuantSpec("e2m1", "tile", block_size=16, scale_format="ue4m3", tensor_scale=True, **AO_OPTIONS)
FP32_MAX = torch.finfo(torch.float32).max


def ao_reference(x: torch.Tensor, tile: int = 1) -> torch.Tensor:
    """torchao's NVFP4 training cast of a 2-D fp32 tensor, dequantized: 1 x 16 blocks along the rows (or
    16 x 16 tiles), the steps of its Triton ``_nvfp4_quantize`` / ``_nvfp4_2d_quantize``."""
    x = x.float()
    amax = x.abs().max()
    safe = torch.where(amax == 0, 1.0, amax)
    e = torch.minimum(torch.tensor(448.0 * 6.0) / safe, torch.tensor(FP32_MAX))
    e = torch.where((e == 0) | (amax == 0), 1.0, e)
    m, n = x.shape
    g = x.reshape(m // tile, tile, n // 16, 16)
    vec_max = g.abs().amax(dim=(1, 3), keepdim=True)
    pv = (vec_max / 6.0 * e).clamp(torch.finfo(torch.float8_e4m3fn).tiny, 448.0)
    s = pv.to(torch.float8_e4m3fn).float()
    enc = torch.minimum(1.0 / (s * (1.0 / e)), torch.tensor(FP32_MAX))
    scaled = (g * enc).clamp(-6.0, 6.0).reshape(m, n)
    q = f4_unpacked_to_f32(f32_to_f4_unpacked(scaled)).reshape(g.shape)
    return ((q * s) * per_tensor_amax_to_scale(amax)).reshape(m, n)


def ao_rht(x: torch.Tensor, signs: tuple[int, ...]) -> torch.Tensor:
    """torchao's wgrad operand: each 16 values of a row times ``get_rht_matrix`` (bf16), an fp32 product
    (its ``tl.dot``) rounded to bf16."""
    b = get_rht_matrix(signs, "cpu", torch.bfloat16, 16).float()
    return (x.bfloat16().float().reshape(-1, 16) @ b).bfloat16().float().reshape(x.shape)


def _data(seed: int = 0) -> torch.Tensor:
    """(64, 128): normal rows, outlier columns, ties of the e2m1 grid, -0, a zero block, tiny blocks (under
    the 2^-6 floor and under e4m3's subnormals) and test_scale_order's ties."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 128, generator=g) * (1 + 6 * (torch.rand(128, generator=g) > 0.9))
    x[1] = torch.tensor(
        [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0, 6.0, 0, 0, 0, 0] * 8
    )
    x[2, :16] = -0.0
    x[3, :16] = 0.0
    x[4, :16] = torch.linspace(-1, 1, 16) * 1e-4
    x[5, :16] = torch.linspace(-1, 1, 16) * 1e-9
    x[7, 0], x[7, 1] = 10.0, 1.25
    return x


def test_every_role_has_torchao_options():
    plan = resolve_plan(QuantizeConfig(recipe="nvfp4_torchao", skip=[]), {"l": LayerShape(256, 256, 128)})[
        "l"
    ]
    for role, (scaling, rounding, r) in {
        "forward.input": ("block", "nearest", 0),
        "forward.weight": ("tile", "nearest", 0),
        "dgrad.grad_output": ("block", "stochastic", 0),
        "dgrad.weight": ("tile", "nearest", 0),
        "wgrad.grad_output": ("block", "stochastic", 16),
        "wgrad.input": ("block", "nearest", 16),
    }.items():
        s = plan.spec(role)
        assert (s.scaling, s.rounding, s.rht, s.block_size, s.tensor_scale) == (
            scaling,
            rounding,
            r,
            16,
            True,
        )
        assert {k: getattr(s, k) for k in AO_OPTIONS} == AO_OPTIONS, role
        assert (s.rht_signs, s.rht_output) == (("te", "bf16") if r else ("seeded", "fp32")), role
        assert s.scale_underflow == "clamp" and s.source == "high", role
    assert {r: dataclasses.replace(s, **OURS) for r, s in RECIPES["nvfp4_torchao"].items()} == RECIPES[
        "nvfp4"
    ]
    assert (
        str(plan.spec("wgrad.input")) == "rht16te/bf16:e2m1/block16@0(ue4m3,exact+t32,minN,recip,aoorder)/rne"
    )
    assert LinearPlan.from_recipe("nvfp4_torchao") == plan


def test_rht_with_bf16_output_equals_torchaos_matrix():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)).bfloat16()
    for signs in (TE_SIGNS, sign_vector(16, 5)):
        spec = QuantSpec.nvfp4(rht=16, rht_signs="te" if signs == TE_SIGNS else "seeded", rht_seed=5)
        bf = operand_rht(x, dataclasses.replace(spec, rht_output="bf16"), -1)
        assert torch.equal(bf, ao_rht(x, signs))
        assert torch.equal(operand_rht(x, spec, -1), rht(x, signs, -1))  # fp32 stays the default
        assert not torch.equal(operand_rht(x, spec, -1), bf)


@pytest.mark.parametrize("scale", [1.0, 3 / 9.0, 1e-3, 1e30, 1e-30])
@pytest.mark.parametrize("tile", [1, 16])
def test_cast_equals_torchaos_arithmetic(tile, scale):
    x = _data() * scale
    spec = TILE if tile == 16 else SPEC
    got = fake_quantize(x, spec)
    want = ao_reference(x, tile)
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    assert torch.signbit(got[2, :16]).all()  # -0 stays -0 (torchao's CPU e2m1 cast; TE's gives +0)


def test_hand_computed_block_scales():
    # Tensor amax 2688 (e = 1): a block of amax 0.03 has raw scale 0.005; torchao floors it to 2^-6 (values
    # 0.03 -> 1.92 -> 2 -> 0.03125); our default keeps e4m3's subnormal 3 x 2^-9 (0.03 -> 5.12 -> 6 -> 0.0352).
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 2688.0, 0.03
    assert fake_quantize(x, SPEC)[0, 16].item() == 0.03125
    assert fake_quantize(x, QuantSpec.nvfp4())[0, 16].item() == 6 * 3 * 2.0**-9
    # Tensor amax 7, block amax 46 x 2^-17: block scale 11 x 2^-9 in our decode order, 12 x 2^-9 in torchao's.
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 7.0, 46 * 2.0**-17
    ts = 7.0 / 2688
    assert abs(fake_quantize(x, SPEC)[0, 16].item() - 6 * 12 * 2.0**-9 * ts) < 1e-12
    assert (
        abs(fake_quantize(x, dataclasses.replace(SPEC, scale_order="decode"))[0, 16] - 6 * 11 * 2.0**-9 * ts)
        < 1e-12
    )
    # Tensor amax 3, block amax 9/1024 (test_scale_order's tie): torchao's block scale 1.25 as ours, TE's 1.375.
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16:32] = 3.0, 9 / 1024
    te = dataclasses.replace(SPEC, scale_order="te")
    assert torch.equal(fake_quantize(x, SPEC), ao_reference(x))
    assert fake_quantize(x, SPEC)[0, 16].item() == pytest.approx(6 * 1.25 * 3 / 2688, rel=1e-6)
    assert fake_quantize(x, te)[0, 16].item() == pytest.approx(6 * 1.375 * 3 / 2688, rel=1e-6)


def test_one_level_cast_equals_torchaos_to_nvfp4():
    # torchao's NVFP4Tensor.to_nvfp4 without a tensor scale runs on the CPU: block scales fl(amax_b / 6)
    # clamped to [2^-6, 448], values times fl(1 / scale): ours with scale_min "normal" and the reciprocal.
    spec = QuantSpec(
        "e2m1", "block", block_size=16, scale_format="ue4m3", scale_min="normal", scale_apply="reciprocal"
    )
    for scale in (1.0, 1e-3, 40.0):
        x = _data(2) * scale
        want = NVFP4Tensor.to_nvfp4(x.contiguous()).dequantize(torch.float32)
        got = fake_quantize(x, spec)
        assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    assert not torch.equal(fake_quantize(x, dataclasses.replace(spec, scale_min="subnormal")), want)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_layer_equals_torchaos_arithmetic_role_by_role(compiled):
    specs = {r: dataclasses.replace(s, rounding="nearest") for r, s in recipe_specs("nvfp4_torchao").items()}
    g = torch.Generator().manual_seed(4)
    x, w = _data(3).bfloat16().float(), (torch.randn(96, 128, generator=g) / 11).bfloat16().float()
    dy = (torch.randn(64, 96, generator=g) * 1e-3).bfloat16().float()
    layer = QuantLinear(128, 96, bias=False, plan=LinearPlan.from_roles(specs))
    layer.weight.data.copy_(w)
    xg = x.clone().requires_grad_()
    y = (torch.compile(layer, fullgraph=True) if compiled else layer)(xg)
    y.backward(dy)
    assert torch.equal(y, ao_reference(x) @ ao_reference(w, 16).t())
    assert torch.equal(xg.grad, ao_reference(dy) @ ao_reference(w, 16))
    dyr, xr = ao_rht(dy.t().contiguous(), TE_SIGNS), ao_rht(x.t().contiguous(), TE_SIGNS)
    assert torch.equal(layer.weight.grad, ao_reference(dyr) @ ao_reference(xr).t())


def test_a_rule_sets_rht_output():
    rule = QuantRule(roles=["wgrad.*"], rht_output="bf16")
    plan = resolve_plan(
        QuantizeConfig(recipe="nvfp4", skip=[], rules=[rule]), {"l": LayerShape(256, 256, 128)}
    )
    assert plan["l"].spec("wgrad.input").rht_output == "bf16"
    assert plan["l"].spec("forward.input").rht_output == "fp32"
