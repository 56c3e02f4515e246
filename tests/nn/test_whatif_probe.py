"""What-if statistics in the graph: the numbers equal the direct computation, the layer's own output and
gradients are untouched (an all-high plan stays exactly F.linear), compiled == eager, rows in numerics.jsonl."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from low_bits_training.config.numerics import NumericsConfig
from low_bits_training.formats import QuantSpec, fake_quantize, grouped_shape, hadamard
from low_bits_training.nn import ROLE_NAMES, ROLES, LinearPlan, ProbeMode, QuantLinear, probe, rng
from low_bits_training.nn.recipes import recipe_specs
from low_bits_training.nn.whatif import WhatIf, WhatIfLinear, _keys, reset
from low_bits_training.numerics import SIZE, operand_stats
from low_bits_training.numerics.whatif import block_range, format_binades, summarize_whatif, whatif_stats
from low_bits_training.plan.whatif import resolve_whatif
from low_bits_training.titan.runtime.numerics import NumericsMonitor

NAMES = ("nvfp4", "mxfp4")
B8 = QuantSpec("e2m1", "block", block_size=8, scale_format="e8m0")


def _table(names=NAMES) -> WhatIf:
    return WhatIf(names, tuple(tuple(recipe_specs(n)[r] for r in ROLE_NAMES) for n in names))


def _layer(plan: LinearPlan | None = None, dtype=torch.float32) -> WhatIfLinear:
    torch.manual_seed(0)
    layer = WhatIfLinear(64, 64, plan=plan, dtype=dtype)
    layer.attach_whatif(_table())
    return layer


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 32, 64, generator=g) * torch.logspace(-2, 1, 64)).to(dtype).requires_grad_()
    dy = torch.randn(2, 32, 64, generator=g).to(dtype)
    return x, dy


@pytest.fixture(autouse=True)
def _stats_mode():
    probe.set_mode(ProbeMode(stats=True))
    rng.set_step_key(1234)
    yield
    probe.set_mode(ProbeMode())
    rng.set_step_key(None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_high_precision_layer_stays_exactly_f_linear(dtype):
    layer = _layer(dtype=dtype)
    x, dy = _inputs(dtype)
    y = layer(x)
    y.backward(dy)
    gx, gw, gb = x.grad, layer.weight.grad, layer.bias.grad
    x2 = x.detach().clone().requires_grad_()
    w, b = layer.weight.detach().clone().requires_grad_(), layer.bias.detach().clone().requires_grad_()
    y2 = F.linear(x2, w, b)
    y2.backward(dy)
    assert (
        torch.equal(y, y2)
        and torch.equal(gx, x2.grad)
        and torch.equal(gw, w.grad)
        and torch.equal(gb, b.grad)
    )
    assert not torch.equal(layer.lbt_whatif, reset_copy(layer.lbt_whatif))  # and it did record


def reset_copy(buf):
    out = buf.clone()
    reset(out)
    return out


def test_a_quantized_layer_computes_as_its_plan_says():
    plan = LinearPlan.from_roles(recipe_specs("mxfp8"))
    layer, plain = _layer(plan), QuantLinear(64, 64, plan=plan)
    plain.load_state_dict(layer.state_dict())
    x, dy = _inputs()
    xp = x.detach().clone().requires_grad_()
    y, yp = layer(x), plain(xp)
    y.backward(dy)
    yp.backward(dy)
    assert (
        torch.equal(y, yp)
        and torch.equal(x.grad, xp.grad)
        and torch.equal(layer.weight.grad, plain.weight.grad)
    )


def test_whatif_numbers_equal_the_statistics_of_fake_quantize_of_the_same_tensor():
    layer = _layer()
    x, dy = _inputs()
    layer(x).backward(dy)
    operands = {
        "input": x.detach().reshape(-1, 64),
        "weight": layer.weight.detach(),
        "grad_output": dy.reshape(-1, 64),
    }
    for i, role in enumerate(ROLES):
        keys = _keys(layer.lbt_key, layer.whatif, i)
        for k in range(len(NAMES)):
            spec = layer.whatif.specs[k][i]
            t32 = operands[role.operand].float()
            if spec.rht:  # nvfp4's weight-gradient operands: measured after the RHT, as the GEMM casts them
                t32 = hadamard.rht(t32, hadamard.sign_vector(spec.rht, spec.rht_seed), role.axis)
            assert spec.axis == (role.axis if spec.scaling == "block" else spec.axis)
            got = layer.lbt_whatif[k, i]
            want = operand_stats(t32, spec, fake_quantize(t32, spec, keys[k]))
            assert torch.equal(got[:SIZE], want), (NAMES[k], role.name)
            assert torch.equal(got, whatif_stats(t32, spec, keys[k]))
    # nvfp4 rounds gradients stochastically, from counter-based keys: another step key, other bits
    assert (
        layer.whatif.specs[0][4].rounding == "stochastic"
        and _keys(layer.lbt_key, layer.whatif, 4)[0] is not None
    )


def test_the_plans_own_recipe_as_whatif_equals_the_probe():
    # a layer computing nvfp4 that also measures nvfp4: the probe (the very casts its GEMMs used) and the
    # what-if agree on every role that rounds to nearest (SR roles draw other bits on purpose)
    layer = _layer(LinearPlan.from_roles(recipe_specs("nvfp4")))
    x, dy = _inputs()
    layer(x).backward(dy)
    for i, spec in enumerate(layer.plan.specs):
        if spec.rounding == "nearest":
            assert torch.equal(layer.lbt_whatif[0, i, :SIZE], layer.lbt_stats[i]), ROLE_NAMES[i]
    assert layer.plan.spec("wgrad.input").rht == 16  # the RHT path is among them


def test_only_statistics_steps_record():
    layer = _layer()
    probe.set_mode(ProbeMode(stats=False, nonfinite=True))
    x, dy = _inputs()
    layer(x).backward(dy)
    assert torch.equal(layer.lbt_whatif, reset_copy(layer.lbt_whatif))


def test_roles_without_a_gemm_are_not_recorded():
    layer = _layer()
    x, dy = _inputs()
    layer(x.detach()).backward(dy)  # x needs no gradient: no dgrad GEMM, as in QuantMatmul
    n = layer.lbt_whatif[..., 0]  # element counts
    ran = [n[0, i].item() > 0 for i in range(len(ROLES))]
    assert ran == [not r.startswith("dgrad") for r in ROLE_NAMES]


def _loop_block_range(x: torch.Tensor, spec: QuantSpec) -> list[float]:
    # slow reference: every scale group on its own, in Python
    gshape, dims = grouped_shape(x.shape, spec)
    xg = x.reshape(gshape).abs().double()
    keep = [d for d in range(xg.dim()) if d not in dims]
    groups = xg.permute(*keep, *dims).reshape(-1, math.prod(xg.shape[d] for d in dims))
    spans = []
    for g in groups:
        nz = g[g > 0]
        if len(nz):
            spans.append(math.log2(nz.max().item() / nz.min().item()))
    over = sum(s > format_binades(spec) for s in spans)
    return [sum(spans), max(spans, default=0.0), float(len(spans)), float(over)]


@pytest.mark.parametrize(
    "spec",
    [B8, QuantSpec.nvfp4(axis=0), QuantSpec("e4m3", "tile", block_size=16), QuantSpec.fp8_rowwise(axis=0)],
)
def test_block_dynamic_range_against_a_loop(spec):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 48, generator=g) * torch.logspace(-4, 2, 48)
    x[5, :16] = 0.0  # whole zero groups do not count
    got = block_range(x, spec).tolist()
    want = _loop_block_range(x, spec)
    assert got == pytest.approx(want, rel=1e-6)
    s = summarize_whatif(torch.cat([operand_stats(x, spec), block_range(x, spec)]))
    assert s["block_dr_mean"] == pytest.approx(want[0] / want[2]) and s["block_dr_over"] == want[3] / want[2]
    assert s["mse"] == pytest.approx((x - fake_quantize(x, spec)).square().mean().item(), rel=1e-6)


def test_compiled_records_what_eager_records():
    out = {}
    for mode in ("eager", "compiled"):
        layer = _layer(LinearPlan.from_roles(recipe_specs("mxfp8")))
        run = torch.compile(layer, fullgraph=True) if mode == "compiled" else layer
        x, dy = _inputs()
        y = run(x)
        y.backward(dy)
        out[mode] = (y.detach(), x.grad, layer.lbt_whatif.clone())
    (ye, ge, we), (yc, gc, wc) = out["eager"], out["compiled"]
    assert torch.allclose(ye, yc, rtol=1e-5, atol=1e-6) and torch.allclose(ge, gc, rtol=1e-5, atol=1e-6)
    # counts, extrema and histograms exactly; float64 energies up to summation order
    assert torch.allclose(we, wc, rtol=1e-9, atol=0)


def test_monitor_writes_whatif_rows_beside_the_plans_own(tmp_path):
    plan = LinearPlan.from_roles(recipe_specs("mxfp8"))
    model = torch.nn.Sequential(_layer(plan), torch.nn.ReLU(), _layer())
    model[2] = WhatIfLinear(64, 32)  # a high-precision layer that measures only the custom alternative
    cfg = NumericsConfig(
        stats_freq=1,
        whatif=["mxfp4", "b8"],
        whatif_layers=["2"],
        whatif_specs={"b8": {"format": "e2m1", "scaling": "block", "block_size": 8, "scale_format": "e8m0"}},
    )
    tables = resolve_whatif(cfg, ["0", "2"], strict=False)
    mon = NumericsMonitor(cfg, [model], str(tmp_path), whatif_tables=tables)
    x, _ = _inputs()
    try:
        mon.begin_step(1)
        model(x).square().mean().backward()
        mon.flush(None)
    finally:
        mon.close()
    rows = [json.loads(r) for r in (tmp_path / "numerics.jsonl").read_text().splitlines()]
    plain = [r for r in rows if "whatif" not in r]
    alt = [r for r in rows if "whatif" in r]
    assert {r["layer"] for r in plain} == {"0"}  # only layer 0 has quantized roles of its own
    assert {(r["layer"], r["whatif"]) for r in alt} == {("2", "mxfp4"), ("2", "b8")}
    assert len(alt) == 2 * len(ROLES)
    row = next(r for r in alt if (r["whatif"], r["role"]) == ("b8", "forward.weight"))
    w = model[2].weight.detach()
    assert row["spec"] == "e2m1/block8(e8m0,exact)/rne"
    assert row["sqnr_db"] == pytest.approx(
        10 * math.log10(w.square().sum() / (w - fake_quantize(w, B8)).square().sum())
    )
    assert {"mse", "block_dr_mean", "block_dr_max", "block_dr_over"} <= set(row)


def test_whatif_rotates_as_each_alternative_says():
    # nvfp4 (seeded signs, fp32 rotation) and nvfp4_torchao (TE's signs, rotation rounded to bf16) measured on
    # one layer: each wgrad operand is rotated and rounded as that alternative's GEMM would cast it.
    names = ("nvfp4", "nvfp4_torchao")
    torch.manual_seed(0)
    layer = WhatIfLinear(64, 64)
    layer.attach_whatif(_table(names))
    x, dy = _inputs()
    layer(x).backward(dy)
    operands = {"input": x.detach().reshape(-1, 64), "grad_output": dy.reshape(-1, 64)}
    for i, role in enumerate(ROLES):
        if not role.name.startswith("wgrad."):
            continue
        keys = _keys(layer.lbt_key, layer.whatif, i)
        for k in range(len(names)):
            spec = layer.whatif.specs[k][i]
            t = hadamard.operand_rht(operands[role.operand].float(), spec, role.axis)
            assert torch.equal(layer.lbt_whatif[k, i], whatif_stats(t, spec, keys[k])), (names[k], role.name)
        ao = layer.whatif.specs[1][i]
        assert ao.rht_output == "bf16" and ao.rht_signs == "te"
        fp32 = hadamard.rht(operands[role.operand].float(), hadamard.operand_signs(ao), role.axis)
        assert not torch.equal(layer.lbt_whatif[1, i], whatif_stats(fp32, ao, keys[1])), role.name
