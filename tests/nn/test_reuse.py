"""Backward roles that reuse an earlier cast of the same tensor (``LinearPlan.reused_casts``): fp8 tensorwise
casts x and dY once each. The result must be bit for bit the one of casting every role, the non-finite flags
the same, and the forward must keep x's cast (in fp8) instead of x."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from low_bits_training.formats import QuantSpec
from low_bits_training.nn import delayed, gemm, probe
from low_bits_training.nn.functional import quant_linear
from low_bits_training.nn.gemm import GemmState, run_gemm
from low_bits_training.nn.probe import LayerState, ProbeMode
from low_bits_training.nn.roles import ROLE_NAMES, LinearPlan

BOTH = {"wgrad.input": "forward.input", "wgrad.grad_output": "dgrad.grad_output"}


def _operands(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-3, 1, 128)
    w = torch.randn(96, 128, generator=g) * 0.05
    dy = torch.randn(64, 96, generator=g) * 1e-3
    return x.to(dtype), w.to(dtype), dy.to(dtype)


def test_which_plans_reuse():
    assert LinearPlan.from_recipe("fp8_tensorwise").reused_casts == BOTH
    assert LinearPlan.from_recipe("fp8_delayed").reused_casts == BOTH
    for recipe in ("fp8_rowwise", "mxfp8", "nvfp4", "int8", "deepseek_fp8"):
        assert LinearPlan.from_recipe(recipe).reused_casts == {}, recipe  # axis-dependent scales, or SR
    sr = QuantSpec.fp8_tensorwise("e5m2", rounding="stochastic")
    specs = dict(zip(ROLE_NAMES, LinearPlan.from_recipe("fp8_tensorwise").specs, strict=True))
    assert LinearPlan.from_roles(specs | {"dgrad.grad_output": sr, "wgrad.grad_output": sr}).reused_casts == {
        "wgrad.input": "forward.input"
    }
    other = dataclasses.replace(specs["forward.input"], saturate=False)
    assert LinearPlan.from_roles(specs | {"wgrad.input": other}).reused_casts == {
        "wgrad.grad_output": "dgrad.grad_output"
    }
    assert LinearPlan.from_recipe("fp8_tensorwise", backend="real").reused_casts == {}


def _reference(x, w, dy, plan, state=probe.NO_STATE, mode=probe.PROBE_OFF):
    """Every role cast from its own tensor (``run_gemm`` without reuse; delayed casts record)."""
    t = {"input": x, "weight": w, "grad_output": dy}
    y = run_gemm("forward", dict(t), plan, {}, state, mode, True).to(x.dtype)
    dx = run_gemm("dgrad", dict(t), plan, {}, state, mode, True).to(x.dtype)
    dw = run_gemm("wgrad", dict(t), plan, {}, state, mode, True).to(w.dtype)
    return y, dx, dw


def _train(x, w, dy, plan, state=probe.NO_STATE):
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = quant_linear(xr, wr, None, plan, None, state)
    y.backward(dy)
    return y.detach(), xr.grad, wr.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reuse_is_bit_for_bit_recasting(dtype):
    plan = LinearPlan.from_recipe("fp8_tensorwise")
    x, w, dy = _operands(dtype)
    for got, want in zip(_train(x, w, dy, plan), _reference(x, w, dy, plan), strict=True):
        assert got.dtype == want.dtype == dtype
        assert torch.equal(got, want)


def test_delayed_scaling_reuses_and_keeps_every_history(monkeypatch):
    """Three steps of growing operands: the histories (one row per role) stay what casting every role
    records, and so do the results; a statistics step in between (no reuse) reads the same rows."""
    plan = LinearPlan.from_recipe("fp8_delayed")
    mine, ref = (
        GemmState(history=delayed.new_history(plan.specs)),
        GemmState(history=delayed.new_history(plan.specs)),
    )
    for step in range(4):
        x, w, dy = (t * (1 + step) for t in _operands(torch.bfloat16, seed=step))
        before = probe.mode()
        probe.set_mode(ProbeMode(stats=step == 2))
        try:
            got = _train(x, w, dy, plan, mine)
        finally:
            probe.set_mode(before)
        want = _reference(x, w, dy, plan, ref)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), step
        assert torch.equal(mine.history, ref.history), step
    assert torch.equal(mine.history[0], mine.history[5]) and torch.equal(mine.history[2], mine.history[4])
    assert (mine.history[:, :4] > 0).all()


def test_four_casts_instead_of_six(monkeypatch):
    seen = []
    cast = gemm.cast_factored
    monkeypatch.setattr(gemm, "cast_factored", lambda t, spec, *a: seen.append(a[2]) or cast(t, spec, *a))
    x, w, dy = _operands(torch.bfloat16)
    _train(x, w, dy, LinearPlan.from_recipe("fp8_tensorwise"))
    assert seen == ["forward.input", "forward.weight", "dgrad.grad_output", "dgrad.weight"]
    seen.clear()
    _train(x, w, dy, LinearPlan.from_recipe("fp8_rowwise"))
    assert seen == list(ROLE_NAMES)


def _saved(plan, x, w):
    """The tensors autograd keeps from the forward of one quantized linear."""
    kept = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        quant_linear(x.clone().requires_grad_(), w.clone().requires_grad_(), None, plan)
    return kept


def test_forward_keeps_the_fp8_cast_of_x_not_x():
    x, w, _ = _operands(torch.bfloat16)
    saved = _saved(LinearPlan.from_recipe("fp8_tensorwise"), x, w)
    shapes = {(tuple(t.shape), t.dtype) for t in saved}
    assert ((64, 128), torch.bfloat16) not in shapes  # x is not kept
    assert ((64, 128), torch.float8_e4m3fn) in shapes  # its forward cast is, in 1 byte an element
    assert sum(t.numel() * t.element_size() for t in saved if t.dim() == 2 and t.shape[0] == 64) == 64 * 128
    rowwise = {(tuple(t.shape), t.dtype) for t in _saved(LinearPlan.from_recipe("fp8_rowwise"), x, w)}
    assert ((64, 128), torch.bfloat16) in rowwise  # recast along the token dim in backward


def test_reused_roles_report_the_same_nonfinite_flags():
    plan = LinearPlan.from_recipe("fp8_tensorwise")
    x, w, dy = _operands(torch.bfloat16)
    x[3, 5], dy[7, 1] = float("nan"), float("inf")

    def flags(mode, run):
        state = LayerState(flags=probe.new_flags())
        before = probe.mode()
        probe.set_mode(mode)
        try:
            run(state)
        finally:
            probe.set_mode(before)
        return state.flags

    reused = flags(ProbeMode(nonfinite=True), lambda s: _train(x, w, dy, plan, s))
    recast = flags(
        ProbeMode(nonfinite=True), lambda s: _reference(x, w, dy, plan, s, ProbeMode(nonfinite=True))
    )
    assert torch.equal(reused, recast)
    by = dict(zip(probe.FLAG_SLOTS, reused.tolist(), strict=True))
    assert (
        by["forward.input"] == by["wgrad.input"] == 1
        and by["dgrad.grad_output"] == by["wgrad.grad_output"] == 1
    )
    assert by["forward.weight"] == by["dgrad.weight"] == 0
