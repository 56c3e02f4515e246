"""``QuantSpec.scale_underflow``: a nonzero group whose exact scale rounds to 0 in its scale format keeps its
values under the smallest scale ("clamp", ours) or becomes 0 ("zero", Transformer Engine's NVFP4, issue 38).

Hand-computed NVFP4 cases: a tensor amax of 2688 makes the fp32 tensor scale 1 (2688 = 448 x 6), so a block's
exact scale is its amax / 6, rounded to ue4m3, whose smallest subnormal is 2**-9."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from low_bits_training.config.quantize import QuantizeConfig, QuantRule
from low_bits_training.formats import QuantSpec, dequantize, fake_quantize, quantize
from low_bits_training.nn.cast import cast
from low_bits_training.nn.group_cast import group_cast
from low_bits_training.optim import StateCodec
from low_bits_training.plan.resolve import LayerShape, resolve_plan

ZERO = QuantSpec.nvfp4(scale_underflow="zero")
CLAMP = QuantSpec.nvfp4()


def blocks(*amaxes: float) -> torch.Tensor:
    """One row per block of 16: the first block's amax 2688 (tensor scale 1), then a block per amax, its
    first value the amax and its second -amax / 2."""
    x = torch.zeros(1 + len(amaxes), 16)
    x[0, 0] = 2688.0
    for i, a in enumerate(amaxes, 1):
        x[i, 0], x[i, 1] = a, -a / 2
    return x


def test_a_block_whose_scale_rounds_to_zero_is_zeroed_or_kept_at_the_smallest_scale():
    # amax 6 / 1024: exact scale 2**-10, half of ue4m3's smallest subnormal, a tie that rounds to even: 0.
    # Clamped to 2**-9 the amax is 3 x 2**-9 (exact) and -amax / 2 is -1.5 x 2**-9. Zeroed: both 0.
    a = 6 / 1024
    x = blocks(a)
    assert fake_quantize(x, CLAMP)[1, :2].tolist() == [a, -a / 2]
    assert fake_quantize(x, ZERO)[1, :2].abs().tolist() == [0.0, 0.0]
    assert torch.equal(dequantize(quantize(x, ZERO)), fake_quantize(x, ZERO))  # codes + scales agree
    assert torch.equal(fake_quantize(x, ZERO)[0], fake_quantize(x, CLAMP)[0])  # the big block: no change


def test_a_block_just_above_the_underflow_is_the_same_either_way():
    # exact scale 0.75 x 2**-9: above the midpoint 2**-10, so it rounds up to 2**-9 (not 0)
    x = blocks(6 * 0.75 / 512, 6 * 0.5 / 512 * 1.01)
    assert torch.equal(fake_quantize(x, ZERO), fake_quantize(x, CLAMP))
    assert fake_quantize(x, ZERO)[1, 0].item() != 0.0


def test_an_all_zero_block_stays_zero_without_nan():
    x = blocks(0.0, 6 / 1024)
    y = fake_quantize(x, ZERO)
    assert not y.isnan().any() and y[1:].abs().sum().item() == 0.0


@pytest.mark.parametrize("apply", ["divide", "reciprocal"])
def test_every_cast_path_zeroes_it(apply):
    spec = dataclasses.replace(ZERO, scale_apply=apply)
    x = blocks(6 / 1024, 0.75, 6 / 2048)  # 0.75: scale 0.125, exact on both grids
    want = fake_quantize(x, spec)
    assert (
        want[1].abs().sum().item() == 0.0 and want[3].abs().sum().item() == 0.0 and want[2, 0].item() == 0.75
    )
    assert torch.equal(cast(x, spec), want)  # nn's operand cast
    assert torch.equal(group_cast(x, spec, torch.zeros(4, dtype=torch.long), 1), want)  # MoE's group cast
    codec = StateCodec(dataclasses.replace(spec, tensor_scale=False))  # optimizer states: one-level blocks
    tiny = torch.full((1, 16), 1e-45)  # an fp32 scale of amax / 6 rounds to 0 only at fp32's bottom
    assert codec.decode(codec.encode(tiny), (1, 16)).abs().sum().item() == 0.0


def test_zero_needs_exact_scales_and_a_rule_sets_it():
    with pytest.raises(
        ValueError, match="scale_underflow='zero' needs scaled groups with scale_rounding 'exact'"
    ):
        QuantSpec.mxfp8(scale_underflow="zero")
    cfg = QuantizeConfig(
        recipe="nvfp4", skip=[], rules=[QuantRule(roles=["wgrad.*"], scale_underflow="zero")]
    )
    plan = resolve_plan(cfg, {"layers.0.w": LayerShape(256, 256, 128)})["layers.0.w"]
    assert plan.spec("wgrad.input").scale_underflow == "zero" and ",uf0" in plan.spec("wgrad.input").short()
    assert plan.spec("forward.input").scale_underflow == "clamp"


def test_compiled_cast_zeroes_it_too():
    x = blocks(6 / 1024, 0.75, 6 / 2048)
    compiled = torch.compile(lambda t: cast(t, ZERO), fullgraph=True)
    assert torch.equal(compiled(x), cast(x, ZERO))
