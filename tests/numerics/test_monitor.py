"""The in-graph probes at unit level: statistics per (layer, role) and the first NaN / Inf, on QuantLinears."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from low_bits_training.config.numerics import NumericsConfig
from low_bits_training.formats import QuantSpec
from low_bits_training.nn import LinearPlan, ProbeMode, probe
from low_bits_training.nn.linear import QuantLinear
from low_bits_training.nn.roles import ROLE_NAMES
from low_bits_training.numerics import operand_stats, summarize
from low_bits_training.titan.runtime.numerics import NumericsMonitor

MX = QuantSpec.mxfp8("e4m3")


def _model(plan0: LinearPlan | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    plan = LinearPlan.from_roles(dict.fromkeys(ROLE_NAMES, MX))
    return nn.Sequential(QuantLinear(64, 64, bias=False, plan=plan0 or plan), QuantLinear(64, 32, plan=plan))


def _step(model, mon, x, step=1):
    mon.begin_step(step)
    loss = model(x).square().mean()
    loss.backward()
    return mon.after_microbatch(loss.detach())


@pytest.fixture
def x():
    return torch.randn(32, 64, generator=torch.Generator().manual_seed(1))


def test_stats_rows_match_direct_computation(tmp_path, x):
    model = _model()
    mon = NumericsMonitor(NumericsConfig(stats_freq=1), [model], str(tmp_path))
    try:
        assert _step(model, mon, x) is None
        mon.flush(None)
    finally:
        mon.close()
    rows = [json.loads(line) for line in (tmp_path / "numerics.jsonl").read_text().splitlines()]
    # layer 0's input needs no gradient: no dgrad GEMM runs there
    want_keys = [("0", r) for r in ROLE_NAMES if not r.startswith("dgrad")] + [("1", r) for r in ROLE_NAMES]
    assert sorted((r["layer"], r["role"]) for r in rows) == sorted(want_keys)
    row = next(r for r in rows if (r["layer"], r["role"]) == ("0", "forward.input"))
    want = summarize(operand_stats(x, MX))
    assert row["underflow"] == pytest.approx(want["underflow"]) and row["amax"] == pytest.approx(want["amax"])
    assert row["sqnr_db"] == pytest.approx(want["sqnr_db"]) and 25 < row["sqnr_db"] < 40  # e4m3: ~31 dB
    w = next(r for r in rows if (r["layer"], r["role"]) == ("1", "dgrad.weight"))
    assert w["amax"] == pytest.approx(model[1].weight.abs().max().item())


def test_nan_weight_is_named_by_layer_and_role(tmp_path, x):
    model = _model()
    with torch.no_grad():
        model[1].weight[3, 5] = float("nan")
    mon = NumericsMonitor(NumericsConfig(), [model], str(tmp_path))
    try:
        ev = _step(model, mon, x, step=7)
    finally:
        mon.close()
    assert (ev.step, ev.module, ev.role, ev.rank) == (7, "1", "forward.weight", 0)
    assert "step 7, module 1, role forward.weight, rank 0" in ev.message()


def test_overflow_inside_a_gemm_is_named_at_its_product(tmp_path, x):
    # e5m2 without saturation and 2^-30 headroom: x / scale overflows to inf inside layer 0's forward GEMM.
    bad = QuantSpec("e5m2", "tensor", saturate=False, margin=-30)
    plan0 = LinearPlan.from_roles({**dict.fromkeys(ROLE_NAMES, MX), "forward.input": bad})
    model = _model(plan0)
    mon = NumericsMonitor(NumericsConfig(), [model], str(tmp_path))
    try:
        ev = _step(model, mon, x)
    finally:
        mon.close()
    assert (ev.module, ev.role) == ("0", "forward.output")


def test_nan_in_backward_names_the_dgrad_role(tmp_path, x):
    model = _model()
    mon = NumericsMonitor(NumericsConfig(), [model], str(tmp_path))
    try:
        mon.begin_step(2)
        y = model(x)
        y.backward(torch.full_like(y, float("nan")))  # the loss gradient itself is NaN
        ev = mon.after_microbatch(torch.tensor(1.0))
    finally:
        mon.close()
    # backward runs layer 1 first: its dgrad GEMM reads grad_output before wgrad does
    assert (ev.module, ev.role) == ("1", "dgrad.grad_output")


def test_off_records_nothing(tmp_path, x):
    model = _model()
    mon = NumericsMonitor(NumericsConfig(nonfinite="off"), [model], str(tmp_path))
    with torch.no_grad():
        model[0].weight.fill_(float("nan"))
    assert _step(model, mon, x) is None
    assert probe.mode() == ProbeMode() and not model[0].lbt_flags.any()


@pytest.mark.parametrize("kw", [{"stats_freq": -1}, {"nonfinite": "panic"}])
def test_config_errors_are_one_line(kw):
    with pytest.raises(ValueError, match=r"^numerics\.\w+ = .*expected") as e:
        NumericsConfig(**kw).check()
    assert "\n" not in str(e.value)


def test_compiled_layers_record_the_same_statistics_and_flags(tmp_path, x):
    # The probes live inside the graph: a fullgraph-compiled model gives the eager rows and the same first NaN.
    out = {}
    for mode in ("eager", "compiled"):
        model = _model()
        run = torch.compile(model, fullgraph=True) if mode == "compiled" else model
        mon = NumericsMonitor(NumericsConfig(stats_freq=1), [model], str(tmp_path / mode))
        (tmp_path / mode).mkdir()
        try:
            assert _step(run, mon, x) is None
            mon.flush(None)
            with torch.no_grad():
                model[1].weight[0, 0] = float("inf")
            out[mode] = (_step(run, mon, x, step=2), (tmp_path / mode / "numerics.jsonl").read_text())
        finally:
            mon.close()
    assert out["eager"][0] == out["compiled"][0]
    assert (out["eager"][0].module, out["eager"][0].role) == ("1", "forward.weight")
    eager_rows = [json.loads(r) for r in out["eager"][1].splitlines()]
    comp_rows = [json.loads(r) for r in out["compiled"][1].splitlines()]
    assert len(eager_rows) == len(comp_rows) == 10  # layer 0 runs no dgrad (its input needs no grad)
    for e, c in zip(eager_rows, comp_rows, strict=True):
        assert (e["layer"], e["role"], e["underflow"], e["amax"]) == (
            c["layer"],
            c["role"],
            c["underflow"],
            c["amax"],
        )
        assert e["sqnr_db"] == pytest.approx(c["sqnr_db"], rel=1e-5)
