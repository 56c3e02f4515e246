"""Each GEMM blocks its operands along its own contraction dim; the module keeps nn.Linear's state."""

import pytest
import torch
from nn_helpers import operands, plan_for

from low_bits_training.formats import QuantSpec, fake_quantize
from low_bits_training.nn import ROLES, LinearPlan, QuantLinear, quant_linear
from low_bits_training.nn.gemm import run_gemm


def test_role_axes():
    assert {r.name: r.axis for r in ROLES} == {
        "forward.input": -1,
        "forward.weight": -1,
        "dgrad.grad_output": -1,
        "dgrad.weight": 0,
        "wgrad.grad_output": 0,
        "wgrad.input": 0,
    }
    plan = plan_for("mxfp8")
    assert plan.spec("wgrad.input").axis == 0 and plan.spec("forward.input").axis == -1


def test_each_gemm_matches_hand_written_casts():
    x, w, dy = operands(m=64, k=96, n=32)
    plan = plan_for("mxfp4")
    fq = lambda t, axis: fake_quantize(t, QuantSpec.mxfp4(axis=axis))  # noqa: E731
    t = {"input": x, "weight": w, "grad_output": dy}
    assert torch.equal(run_gemm("forward", t, plan, {}), fq(x, -1) @ fq(w, -1).t())
    assert torch.equal(run_gemm("dgrad", t, plan, {}), fq(dy, -1) @ fq(w, 0))
    assert torch.equal(run_gemm("wgrad", t, plan, {}), fq(dy, 0).t() @ fq(x, 0))


def test_wgrad_blocks_run_along_tokens():
    # 48 tokens: the forward (blocks along K=64) is fine, the weight gradient (blocks along M) is not.
    x = torch.randn(48, 64, requires_grad=True)
    w = torch.randn(32, 64, requires_grad=True)
    y = quant_linear(x, w, None, plan_for("mxfp8"))
    with pytest.raises(ValueError, match="dim 0 of size 48"):
        y.sum().backward()


def test_quant_linear_state_dict_is_linear():
    lin = torch.nn.Linear(64, 32)
    q = QuantLinear(64, 32, plan=plan_for("fp8_rowwise"))
    assert q.state_dict().keys() == lin.state_dict().keys()
    q.load_state_dict(lin.state_dict())
    lin.load_state_dict(q.state_dict())
    x = torch.randn(2, 8, 64)
    assert torch.equal(QuantLinear.from_linear(lin, LinearPlan())(x), lin(x))
    assert 20 < 10 * torch.log10(lin(x).pow(2).sum() / (q(x) - lin(x)).pow(2).sum()) < 40


def test_compile_matches_eager():
    q = QuantLinear(64, 32, bias=False, plan=plan_for("fp8_rowwise"))
    x = torch.randn(4, 16, 64)
    eager = q(x)
    compiled = torch.compile(q, backend="aot_eager")(x)  # traceable: no graph break needed
    assert torch.equal(compiled, eager)
