"""``QuantSpec.scale_apply``: a value meets its group's scale by division (ours) or by the fp32 reciprocal of the
scale (Transformer Engine's quantizers, issue 38), on every path that casts: formats, the GEMM operand casts
of ``nn``, MoE's per-group casts, optimizer states.

The oracle is written from the definition: q = RNE_e2m1(clamp(x * fl(1 / scale), +-6)) with ml_dtypes' e2m1
cast, times the scale."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import torch

from low_bits_training.config.quantize import QuantizeConfig, QuantRule
from low_bits_training.formats import QuantSpec, fake_quantize, group_scales, grouped_shape
from low_bits_training.nn.cast import cast
from low_bits_training.nn.group_cast import group_cast
from low_bits_training.optim import StateCodec
from low_bits_training.plan.resolve import LayerShape, resolve_plan


def _reciprocal(spec: QuantSpec) -> QuantSpec:
    return dataclasses.replace(spec, scale_apply="reciprocal")


def midpoint_heavy(rows: int = 64, cols: int = 256, seed: int = 0) -> torch.Tensor:
    """Values that are exact e2m1 midpoints of a non-power-of-two scale: the grid's ties, where division and
    the reciprocal may disagree (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 times scales like 120 or 7)."""
    g = torch.Generator().manual_seed(seed)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    x = mids[torch.randint(0, 7, (rows, cols), generator=g)]
    x = x * torch.where(torch.rand(rows, cols, generator=g) < 0.5, -1.0, 1.0)
    x[:, ::16] = 6.0  # every 1x16 block's amax maps to 6: block scale = its row scale
    return x * torch.tensor([120.0, 7.0, 3.0, 1.1])[torch.arange(rows) % 4, None]


def oracle(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """fake_quantize under ``scale_apply = "reciprocal"`` from the definition, with our scales."""
    gshape, dims = grouped_shape(x.shape, spec)
    xg = x.reshape(gshape).float()
    scale = group_scales(xg, spec, dims).scale
    inv = (np.float32(1.0) / scale.numpy().astype(np.float32)).astype(np.float32)
    q = np.clip((xg.numpy() * inv).astype(np.float32), -6.0, 6.0).astype(ml_dtypes.float4_e2m1fn)
    return (torch.from_numpy(q.astype(np.float32)) * scale).reshape(x.shape)


def test_a_midpoint_rounds_the_other_way_by_the_reciprocal():
    # issue 38's example: -300 under a scale of 120 (= 720 / 6). -300 / 120 = -2.5 exactly, a tie: even, -2.
    # fl(1 / 120) is a little above 1/120, so -300 * fl(1 / 120) = -2.5000002: -3.
    x = torch.tensor([[-300.0, 720.0, 1.0, 2.0]])
    spec = QuantSpec("e2m1", "tensor")
    assert fake_quantize(x, spec)[0, 0].item() == -240.0
    assert fake_quantize(x, _reciprocal(spec))[0, 0].item() == -360.0
    assert cast(x, _reciprocal(spec))[0, 0].item() == -360.0  # the GEMM operand's cast (nn) too


@pytest.mark.parametrize(
    "spec",
    [
        QuantSpec("e2m1", "tensor"),
        QuantSpec("e2m1", "block", block_size=16),
        QuantSpec.nvfp4(),
        QuantSpec("e2m1", "tile", block_size=16, scale_format="ue4m3", tensor_scale=True),
        QuantSpec.nvfp4(four_over_six="mse"),
    ],
    ids=["tensor", "block16-fp32", "nvfp4", "nvfp4-tile16", "nvfp4-4over6"],
)
def test_reciprocal_equals_the_definition_and_differs_from_division_on_ties(spec):
    x = midpoint_heavy()
    got = fake_quantize(x, _reciprocal(spec))
    assert torch.equal(got, oracle(x, _reciprocal(spec)))
    differ = (got != fake_quantize(x, spec)).float().mean().item()
    if spec.four_over_six == "off":  # 4over6 moves these blocks' amax to 4: no ties left (measured 0%)
        assert differ > 0.05  # measured 9.9% of the elements (the ties of the scales 120, 7 and 1.1)


@pytest.mark.parametrize(
    "spec", [QuantSpec.mxfp8(), QuantSpec.mxfp4(), QuantSpec("e4m3", "tensor", scale_rounding="ceil")]
)
def test_power_of_two_scales_give_the_same_bits_either_way(spec):
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(2)) * 100
    assert torch.equal(fake_quantize(x, _reciprocal(spec)), fake_quantize(x, spec))


@pytest.mark.parametrize(
    "spec",
    [QuantSpec("e2m1", "tensor"), QuantSpec("e2m1", "axis"), QuantSpec.nvfp4()],
    ids=["tensor", "axis", "nvfp4"],
)
def test_every_cast_path_applies_it(spec):
    x = midpoint_heavy(32, 128)
    want = fake_quantize(x, _reciprocal(spec))
    assert torch.equal(cast(x, _reciprocal(spec)), want)  # nn's operand cast (global-amax or grouped path)
    one_group = torch.zeros(32, dtype=torch.long)
    assert torch.equal(group_cast(x, _reciprocal(spec), one_group, 1), want)  # MoE's per-group cast


def test_optimizer_states_apply_it():
    spec = QuantSpec("e2m1", "block", block_size=16)
    x = midpoint_heavy(8, 256)
    for s in (spec, _reciprocal(spec)):
        c = StateCodec(s)
        assert torch.equal(c.decode(c.encode(x), (8, 256)), fake_quantize(x, s))


def test_a_rule_sets_it_and_the_plan_table_shows_it():
    cfg = QuantizeConfig(
        recipe="nvfp4", skip=[], rules=[QuantRule(roles=["forward.*"], scale_apply="reciprocal")]
    )
    plan = resolve_plan(cfg, {"layers.0.w": LayerShape(256, 256, 128)})["layers.0.w"]
    assert plan.spec("forward.input").scale_apply == "reciprocal"
    assert ",recip)" in plan.spec("forward.input").short()
    assert plan.spec("dgrad.grad_output").scale_apply == "divide"


def test_compiled_cast_gives_the_eager_bits():
    # inductor must keep fl(1 / scale) and the multiply (no fused or approximate reciprocal on the CPU)
    spec = _reciprocal(QuantSpec.nvfp4())
    x = midpoint_heavy(32, 128)
    compiled = torch.compile(lambda t: cast(t, spec), fullgraph=True)
    assert torch.equal(compiled(x), cast(x, spec))
