"""The grouped expert GEMM: each expert exactly as a linear layer under the same plan, per expert group."""

import dataclasses
import math

import pytest
import torch
from nn_helpers import plan_for, saved_bytes, sqnr_db

from low_bits_training.formats import QuantSpec
from low_bits_training.nn import LinearPlan, functional, rng
from low_bits_training.nn.cast import cast
from low_bits_training.nn.gemm import run_gemm
from low_bits_training.nn.group_cast import group_cast
from low_bits_training.nn.grouped import Groups, grouped_linear, pad_multiple, run_grouped_gemm
from low_bits_training.nn.recipes import RECIPES

QUANTIZED = sorted(set(RECIPES) - {"bf16"})
GROUPED = [r for r in QUANTIZED if not any(s and (s.rht or s.amax_history) for s in RECIPES[r].values())]
"""Recipes the grouped GEMM computes: an RHT or delayed scaling is refused for expert weights (one line,
plan/options.py), so those recipes are not compared here."""
E, K, N = 4, 128, 128


def _nearest(plan: LinearPlan) -> LinearPlan:
    """The plan with stochastic rounding replaced by nearest (exactness needs the same random bits)."""
    specs = tuple(s if s is None else dataclasses.replace(s, rounding="nearest") for s in plan.specs)
    return LinearPlan(specs, plan.backends)


def _routed(counts: list[int], multiple: int, seed: int = 0, tail: int = 0):
    """Expert-sorted tokens x (R, K) with each group zero-padded to ``multiple``, offs, and the groups."""
    g = torch.Generator().manual_seed(seed)
    padded = [max(c, 1 if multiple == 1 else multiple) if c else 0 for c in counts]
    padded = [-(-p // multiple) * multiple for p in padded]
    rows = []
    for c, p in zip(counts, padded, strict=True):
        scale = 1 + 4 * (torch.rand(K, generator=g) > 0.95)  # a few outlier channels
        rows += [torch.randn(c, K, generator=g) * scale, torch.zeros(p - c, K)]
    x = torch.cat([*rows, torch.zeros(tail, K)])
    offs = torch.tensor(padded, dtype=torch.int64).cumsum(0).to(torch.int32)
    w = torch.randn(E, N, K, generator=g) / K**0.5
    dy = torch.randn(x.shape[0], N, generator=g) * 1e-3
    return x, w, dy, offs


def _per_expert(gemm: str, x, w, dy, offs, plan):
    """Each expert's GEMM by the linear layer's own ``run_gemm`` (QuantLinear's casts) on its rows."""
    starts = [0, *offs.tolist()[:-1]]
    outs = []
    for e, (s, t) in enumerate(zip(starts, offs.tolist(), strict=True)):
        tensors = {"input": x[s:t], "weight": w[e], "grad_output": dy[s:t]}
        if s == t:  # an expert without tokens: no GEMM, a zero weight gradient
            outs.append(torch.zeros(N, K) if gemm == "wgrad" else x[s:t, : N if gemm == "forward" else K])
            continue
        outs.append(run_gemm(gemm, tensors, plan, {}))
    return torch.stack(outs) if gemm == "wgrad" else torch.cat(outs)


@pytest.mark.parametrize("recipe", GROUPED)
def test_grouped_equals_each_expert_as_a_linear_layer(recipe):
    plan = _nearest(plan_for(recipe))
    m = pad_multiple(plan)
    x, w, dy, offs = _routed([37, 0, 90, 5], m, tail=2 * m)
    groups = Groups(offs, x.shape[0], w.shape)
    tensors = {"input": x, "weight": w.reshape(-1, K), "grad_output": dy}
    valid = int(offs[-1])
    for gemm in ("forward", "dgrad", "wgrad"):
        got = run_grouped_gemm(gemm, tensors, plan, groups)
        ref = _per_expert(gemm, x, w, dy, offs, plan)
        if gemm != "wgrad":
            assert torch.equal(got[valid:], torch.zeros_like(got[valid:]))  # the padded tail stays 0
            got = got[:valid]
        assert torch.equal(got, ref), f"{recipe} {gemm}"
    starts = [0, *offs.tolist()[:-1]]
    # and the forward GEMM's casts, expert by expert, equal the dense layer's
    for spec, t, gid in (
        (plan.specs[0], x, groups.tokens),
        (plan.specs[1], tensors["weight"], groups.weights),
    ):
        q = group_cast(t, spec, gid, E)
        for e, (s, t_end) in enumerate(zip(starts, offs.tolist(), strict=True)):
            rows = slice(s, t_end) if gid is groups.tokens else slice(e * N, (e + 1) * N)
            if rows.stop > rows.start:
                assert torch.equal(q[rows], cast(t[rows], spec)), f"{recipe} expert {e}"


def test_pad_multiple_follows_the_token_blocks():
    assert {r: pad_multiple(plan_for(r)) for r in QUANTIZED} == {
        "deepseek_fp8": 128,  # 1x128 blocks along the tokens in wgrad
        "fp8_rowwise": 1,  # column scales per group need no padding
        "fp8_rowwise_hp_wgrad": 1,
        "fp8_tensorwise": 1,
        "int8": 1,
        "mxfp4": 32,
        "mxfp6": 32,
        "mxfp8": 32,
        "nvfp4": 16,
        "fp8_delayed": 1,
        "fp8_rowwise_2d_weights": 1,
        "mxfp8_2d_weights": 32,
        "nvfp4_1d_weights": 16,
        "nvfp4_4over6": 16,
        "nvfp4_no_rht": 16,
        "nvfp4_no_sr": 16,
        "nvfp4_te": 16,
        "nvfp4_torchao": 16,
        "fp8_block_te": 128,
        "fp8_block_te_exact": 128,
    }


def test_tensor_scale_is_per_expert():
    # Two experts whose amax differ 1000x: one shared scale would flush the small one to zero in e4m3.
    x = torch.cat([torch.randn(8, 16) * 1000, torch.randn(8, 16) * 1e-3])
    gid = torch.tensor([0] * 8 + [1] * 8)
    q = group_cast(x, QuantSpec.fp8_tensorwise(), gid, 2)
    assert sqnr_db(q[8:], x[8:]) > 25 and sqnr_db(q[:8], x[:8]) > 25


def test_block_size_that_does_not_divide_is_one_line():
    with pytest.raises(ValueError, match=r"wgrad.input \(48, 64\).*block_size=32 does not divide dim 0"):
        group_cast(
            torch.randn(48, 64),
            QuantSpec.mxfp8(axis=0),
            torch.zeros(48, dtype=torch.long),
            1,
            role="wgrad.input",
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp8_sqnr_against_fp32(dtype):
    plan = plan_for("mxfp8")
    x, w, dy, offs = _routed([40, 88, 0, 120], 32)
    out = {}
    for name, p in (("ref", LinearPlan()), ("q", plan)):
        xg, wg = x.to(dtype).clone().requires_grad_(), w.to(dtype).clone().requires_grad_()
        y = grouped_linear(xg, wg, offs, p) if name == "q" else _hp(xg, wg, offs)
        y.backward(dy.to(y.dtype))
        out[name] = (y.detach(), xg.grad, wg.grad)
    for what, q, r in zip(("output", "grad_input", "grad_weight"), out["q"], out["ref"], strict=True):
        assert 27.0 < sqnr_db(q, r) < 34.0, what  # the linear layer's mxfp8 floors (tests/nn/test_sqnr.py)


def _hp(x, w, offs):
    return torch._grouped_mm(x.float(), w.float().transpose(-2, -1), offs=offs)


def test_mxfp8_agrees_with_torchao_emulated_grouped_mm():
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm

    x, w, dy, offs = _routed([64, 32, 96, 64], 32)
    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)
    got = {}
    for name in ("ours", "torchao"):
        xg, wg = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
        if name == "ours":
            y = grouped_linear(xg, wg, offs, plan_for("mxfp8"))
        else:
            y = _quantize_then_scaled_grouped_mm(xg, wg.transpose(-2, -1), config=config, offs=offs)
        y.backward(dy.bfloat16())
        got[name] = (y.detach(), xg.grad, wg.grad)
    for ours, theirs in zip(got["ours"], got["torchao"], strict=True):
        assert sqnr_db(ours.float(), theirs.float()) > 45  # same casts; bf16 outputs, summation order


def test_stochastic_rounding_is_keyed_and_compiles():
    plan = plan_for("nvfp4")  # stochastic gradients
    x, w, dy, offs = _routed([16, 48, 32, 16], 16)
    rng.set_step_key(1234)
    try:
        key = torch.tensor(rng.layer_key("layers.0.moe.experts.w1"))

        def step(fn):
            xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
            fn(xg, wg).backward(dy)
            return wg.grad

        def f(a, b):
            return grouped_linear(a, b, offs, plan, (key, None, None))

        eager = step(f)
        assert torch.equal(step(f), eager)  # same key, same bits
        assert torch.equal(step(torch.compile(f, backend="aot_eager", fullgraph=True)), eager)
        rng.set_step_key(99)
        assert not torch.equal(step(f), eager)  # another step rounds differently
    finally:
        rng.set_step_key(None)


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "mxfp8"])
def test_compiled_backward_keeps_the_expert_weights_not_their_cast(recipe, monkeypatch):
    """As for linear layers (tests/nn/test_compile.py): compiled, the partitioner kept the forward's fp32
    cast (or upcast) of the stacked expert weights for the backward instead of the weights, unless the
    backward reads them through a copy (``functional.recast_under_compile``); the results are the same."""
    x, w, _, offs = _routed([16, 48, 32, 32], 32)
    x, w = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    plan = plan_for(recipe)

    def block(a, b):
        return torch.nn.functional.silu(grouped_linear(a, b, offs, plan))

    def run(recast: bool):
        torch._dynamo.reset()
        monkeypatch.setattr(functional, "recast_under_compile", lambda plan: recast)
        saved = saved_bytes(torch.compile(block, fullgraph=True), x, w)
        grads = (x.grad, w.grad)
        x.grad = w.grad = None
        return {(math.prod(shape), dtype) for shape, dtype in saved}, grads

    assert functional.recast_under_compile(plan)
    _, kept = run(recast=False)
    saved, recast = run(recast=True)
    assert (w.numel(), torch.float32) not in saved, saved
    assert (w.numel(), torch.bfloat16) in saved  # the weights themselves
    assert all(torch.equal(a, b) for a, b in zip(kept, recast, strict=True))


def test_an_expert_weight_takes_a_plan_mid_run_only_within_its_padding():
    """``GroupedQuantState`` as the schedule and the autopilot switch it: a promoted spec loses the options
    the grouped GEMM lacks (``fit_spec``); a plan whose token blocks need more padding than the dispatcher
    gives, or with an RHT, is refused in one line (``check_plan``)."""
    from low_bits_training.nn.grouped import GroupedQuantState, grouped_spec

    mx, nv = LinearPlan.from_recipe("mxfp8"), LinearPlan.from_recipe("nvfp4")
    state = GroupedQuantState(LinearPlan(), "layers.0.moe.routed_experts.inner_experts.w1", pad=16)
    rht = next(s for s in nv.specs if s is not None and s.rht)
    assert state.fit_spec(rht) == dataclasses.replace(rht, rht=0) == grouped_spec(rht)
    assert state.fit_spec(None) is None
    state.check_plan(LinearPlan(tuple(grouped_spec(s) for s in nv.specs)))  # 16-blocks: pads to 16
    with pytest.raises(ValueError, match=r"padded to a multiple of 32; the dispatcher pads to 16"):
        state.check_plan(mx)
    with pytest.raises(ValueError, match="no RHT, delayed scaling or forward-cast source"):
        state.check_plan(nv)
