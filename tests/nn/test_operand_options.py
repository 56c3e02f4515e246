"""GEMM operand options in the quantized matmul: the RHT (cancels; raises the wgrad SQNR of MXFP4 with outlier
tokens), casts from the forward copy (``source``), one-line errors for combinations that cannot work, and
eager == compiled bit for bit with all of them (delayed scaling's history included)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from nn_helpers import linear_grads, operands, plan_for, sqnr_db

from low_bits_training.formats import QuantSpec, fake_quantize
from low_bits_training.formats.hadamard import rht, sign_vector
from low_bits_training.nn import ROLE_NAMES, LinearPlan, QuantLinear, quant_linear, rng
from low_bits_training.nn.gemm import run_gemm

HIGH = QuantSpec("fp32", "none")  # "quantizes" to fp32: the identity on fp32 values


def _with(specs: dict, roles, **changes) -> LinearPlan:
    specs = dict(specs)
    for r in roles:
        specs[r] = dataclasses.replace(specs[r], **changes)
    return LinearPlan.from_roles(specs)


def _outlier_tokens(seed: int):
    """x (256, 256) whose 5% outlier tokens carry 20x activations (outliers along the weight-gradient GEMM's
    contraction dim), w (384, 256), dy (256, 384)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, 256, generator=g) * (1 + 19 * (torch.rand(256, 1, generator=g) > 0.95))
    return x, torch.randn(384, 256, generator=g) / 16, torch.randn(256, 384, generator=g) * 1e-3


@pytest.mark.parametrize("gemm", ["forward", "dgrad", "wgrad"])
def test_rht_with_high_precision_elements_equals_the_plain_gemm(gemm):
    x, w, dy = operands(m=64, k=128, n=96)
    t = {"input": x, "weight": w, "grad_output": dy}
    plain = run_gemm(gemm, dict(t), LinearPlan.from_roles(dict.fromkeys(ROLE_NAMES, HIGH)), {})
    plan = _with(dict.fromkeys(ROLE_NAMES, HIGH), [r for r in ROLE_NAMES if r.startswith(gemm)], rht=16)
    got = run_gemm(gemm, dict(t), plan, {})
    assert not torch.equal(got, plain)  # it did transform
    assert (got - plain).abs().max() <= 1e-6 * plain.abs().max()  # ... and cancelled, to fp32 rounding


def test_rht_gemm_is_the_gemm_of_the_transformed_casts():
    x, w, dy = operands(m=64, k=128, n=96)
    plan = plan_for("nvfp4_no_sr")
    s = sign_vector(16, 0)
    q = lambda t: fake_quantize(rht(t, s, 0), QuantSpec.nvfp4(axis=0))  # noqa: E731
    got = run_gemm("wgrad", {"input": x, "weight": w, "grad_output": dy}, plan, {})
    assert torch.equal(got, q(dy).t() @ q(x))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_rht_and_the_wgrad_sqnr_with_outlier_tokens(fmt, seed):
    # MXFP4: measured 13.7 -> 15.7 and 14.1 -> 15.8 dB: power-of-two (floor) scales clip a block's outlier to
    # 6, the RHT spreads it over the block. NVFP4: 17.49 -> 16.58 and 17.75 -> 17.16 dB: its exact ue4m3 block
    # scales clip nothing, so the RHT brings no per-GEMM gain (docs/precision_plan.md, "Hadamard transforms").
    x, w, dy = _outlier_tokens(seed)
    ref = linear_grads(x, w, dy, None)[2]
    spec = getattr(QuantSpec, fmt)()
    plain = LinearPlan.from_roles(dict.fromkeys(ROLE_NAMES, spec))
    rotated = _with(dict.fromkeys(ROLE_NAMES, spec), ["wgrad.grad_output", "wgrad.input"], rht=16)
    s_plain = sqnr_db(linear_grads(x, w, dy, plain)[2], ref)
    s_rht = sqnr_db(linear_grads(x, w, dy, rotated)[2], ref)
    if fmt == "mxfp4":
        assert s_rht > s_plain + 1.2, (s_plain, s_rht)
    else:
        assert s_rht < s_plain + 0.2, (s_plain, s_rht)


def test_source_forward_casts_the_forward_copy_again():
    x, w, dy = operands(m=64, k=128, n=96)
    fwd, bwd = QuantSpec.nvfp4(), QuantSpec.nvfp4(source="forward")
    plan = LinearPlan.from_roles(
        {"forward.input": fwd, "forward.weight": fwd, "dgrad.grad_output": fwd, "dgrad.weight": bwd,
         "wgrad.grad_output": fwd, "wgrad.input": bwd}
    )  # fmt: skip
    assert plan.saved_casts == ("forward.weight", "forward.input")
    _, dx, dw = linear_grads(x, w, dy, plan)
    q = lambda t, axis: fake_quantize(t, QuantSpec.nvfp4(axis=axis))  # noqa: E731
    assert torch.equal(dx, q(dy, -1) @ q(q(w, -1), 0))
    assert torch.equal(dw, q(dy, 0).t() @ q(q(x, -1), 0))
    # With 16x16 weight tiles the forward copy is already on the grid: cast again, it stays (idempotent).
    tile = plan_for("nvfp4_no_sr").spec("forward.weight")
    assert torch.equal(fake_quantize(fake_quantize(w, tile), tile), fake_quantize(w, tile))


@pytest.mark.parametrize(
    ("roles", "changes", "msg"),
    [
        (
            ["wgrad.input"],
            {"rht": 16},
            "wgrad: the RHT .* differ, \\(0, 0, 'seeded'\\) vs \\(16, 0, 'seeded'\\)",
        ),
        (["wgrad.*"], {"rht": 16, "rht_seed": 0}, None),
        (["forward.input"], {"source": "forward"}, "forward.input: source = 'forward' is for dgrad.weight"),
    ],
)
def test_operand_combinations(roles, changes, msg):
    specs = plan_for("nvfp4").specs
    by = dict(zip(ROLE_NAMES, (dataclasses.replace(s, rht=0) for s in specs), strict=True))
    import fnmatch

    for r in [n for n in ROLE_NAMES if any(fnmatch.fnmatch(n, p) for p in roles)]:
        by[r] = dataclasses.replace(by[r], **changes)
    if msg is None:
        LinearPlan.from_roles(by)
    else:
        with pytest.raises(ValueError, match=msg):
            LinearPlan.from_roles(by)


def test_source_forward_from_a_rotated_forward_cast_is_refused():
    specs = dict(zip(ROLE_NAMES, plan_for("nvfp4").specs, strict=True))
    specs["forward.weight"] = specs["forward.input"] = dataclasses.replace(QuantSpec.nvfp4(), rht=16)
    specs["dgrad.weight"] = QuantSpec.nvfp4(source="forward", rht=16)
    specs["dgrad.grad_output"] = QuantSpec.nvfp4(rht=16)
    with pytest.raises(
        ValueError, match="dgrad.weight: source = 'forward' reads forward.weight, which has an RHT"
    ):
        LinearPlan.from_roles(specs)


def test_compiled_equals_eager_with_every_option():
    """One layer with RHT (wgrad), 4over6, SR, a forward-copy source and delayed scaling: three steps eager
    and compiled (fullgraph) give the same outputs, gradients and amax histories bit for bit."""
    specs = dict(zip(ROLE_NAMES, plan_for("nvfp4_4over6").specs, strict=True))
    specs["dgrad.weight"] = dataclasses.replace(QuantSpec.nvfp4(), source="forward")
    specs["forward.input"] = QuantSpec.fp8_tensorwise(amax_history=4, amax_compute="max")
    specs["dgrad.grad_output"] = QuantSpec.fp8_tensorwise("e5m2", amax_history=4, amax_compute="most_recent")
    plan = LinearPlan.from_roles(specs)
    x, w, dy = operands(m=64, k=128, n=96)
    runs = []
    for compiled in (False, True):
        layer = QuantLinear(128, 96, bias=False, plan=plan)
        layer.weight.data.copy_(w)
        layer.set_name("layers.0.mlp")
        fn = torch.compile(layer, backend="inductor", fullgraph=True) if compiled else layer
        out = []
        for step in range(3):
            rng.set_step_key(1000 + step)
            xi = (x * (1 + step)).requires_grad_()
            y = fn(xi)
            y.backward(dy * (2 - step))
            out += [y.detach(), xi.grad, layer.weight.grad.clone()]
            layer.weight.grad = None
        runs.append((out, layer.lbt_amax_history.clone()))
    rng.set_step_key(None)
    (eager, h_eager), (comp, h_comp) = runs
    assert (
        h_eager[0, 2] > 0 and h_eager[2, 2] > 0 and h_eager[1].abs().sum() == 0
    )  # 3 casts each, role 1 none
    assert torch.equal(h_eager, h_comp)
    for i, (a, b) in enumerate(zip(eager, comp, strict=True)):
        assert torch.equal(a, b), f"tensor {i} (step {i // 3}) differs"


def test_quant_linear_plain_state_tuple_still_works():
    x, w, _ = operands(m=32, k=64, n=48)
    y = quant_linear(x, w, None, plan_for("nvfp4_no_sr"))
    assert y.shape == (32, 48)
