"""Adding a kind of plan target is one ``TargetKind`` plus one line of ``registry.TARGETS`` (issue 41): a toy
kind registered here (one GEMM entry, ``toy.gemm``, its own module label) is resolved with the recipe, listed
by the plan table and its saved files, counted by lbt-doctor's backend row, and its FLOPs reach the report's
share of GEMM FLOPs per format. Nothing outside the registry names the kinds
(``test_targets.test_no_other_module_enumerates_the_kinds``). The numerics monitor loops over the live
``QuantState`` modules of the model, whatever their kind (``nn.state.live_targets``): the toy's module (a
``QuantState`` whose one GEMM runs the resolved plan) gets statistics rows and is named by the first-NaN check
under its plan entry, with no line of the monitor changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import DEBUG_TOML
from low_bits_training.cli.plan_checks import check_backends
from low_bits_training.config.numerics import NumericsConfig
from low_bits_training.nn.hardware import Hardware
from low_bits_training.nn.state import QuantState
from low_bits_training.nn.tp import linear
from low_bits_training.plan.resolve import LayerShape
from low_bits_training.report.runs import LOSS, RunData, flop_shares
from low_bits_training.titan.runtime.numerics import NumericsMonitor
from low_bits_training.titan.targets import registry
from low_bits_training.titan.targets.kind import TargetKind

BUILT: dict = {}
"""What the toy's converter "built" (a real kind rewrites the model config tree; ``current`` reads it back)."""

TOY = TargetKind(
    name="toy",
    what="a toy GEMM",
    switchable=False,
    entries=lambda config: {"toy.gemm": LayerShape(64, 32, tokens_multiple=config.training.seq_len)},
    convert=lambda config, run: BUILT.update({"toy.gemm": run.plans["toy.gemm"]}),
    label=lambda plans, fqn: "ToyGemm",
    current=lambda model: {f: (p, "ToyGemm") for f, p in BUILT.items()},
)


def _config():
    from low_bits_training.titan.launch.configure import load_config

    return load_config(str(DEBUG_TOML), ["--quantize.recipe", "mxfp8"])


def test_a_toy_kind_is_resolved_listed_counted_and_reported(monkeypatch, tmp_path):
    monkeypatch.setattr(registry, "TARGETS", (*registry.TARGETS, TOY))
    config = _config()
    run = registry.resolve_run(config)
    toy = run.plans["toy.gemm"]
    assert run.kinds["toy.gemm"] is TOY and run.labels()["toy.gemm"] == "ToyGemm"
    assert toy == run.plans["layers.0.attention.wo"]  # the recipe reaches it as it reaches a linear layer
    assert toy.spec("forward.input").format == "e4m3" and toy.spec("forward.input").block_size == 32

    registry.apply_run(config, run)  # the converters, every kind (the toy's too)
    table = registry.save_plan(config, tmp_path).read_text()  # what the launcher writes and logs
    assert "toy.gemm" in table and "ToyGemm" in table
    plans = json.loads((tmp_path / "precision_plan.json").read_text())
    sizes = json.loads((tmp_path / "gemm_sizes.json").read_text())
    assert "toy.gemm" in plans and sizes["toy.gemm"] == [64, 32, 1]

    row = check_backends(config, Hardware("cpu"))  # lbt-doctor's backends row
    assert "1 x ToyGemm [emulate]" in row.detail

    shares = {
        s["format"]: s["share"]
        for s in flop_shares(RunData("r", Path(tmp_path), metrics=[{"step": 1, LOSS: 3.0}]))
    }
    total = sum(n_in * n_out * (c or [1])[0] for n_in, n_out, *c in sizes.values())
    quantized = sum(v for k, v in shares.items() if k != "bf16")  # the toy's share is among the quantized
    assert abs(sum(shares.values()) - 1) < 1e-12 and quantized >= 64 * 32 / total


class ToyGemm(QuantState, nn.Module):
    """The toy kind's module: one weight, one quantized GEMM under the plan entry ``toy.gemm``."""

    lbt_target = "toy.gemm"

    def __init__(self, plan):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 64, generator=torch.Generator().manual_seed(0)) / 8)
        self.plan = plan
        self.init_state_buffers(name=self.lbt_target)

    def forward(self, x):
        return linear(x, self.weight, None, self.plan, self.state)


def test_the_monitor_reads_a_toy_kinds_module(monkeypatch, tmp_path):
    monkeypatch.setattr(registry, "TARGETS", (*registry.TARGETS, TOY))
    toy = ToyGemm(registry.resolve_run(_config()).plans["toy.gemm"])
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    mon = NumericsMonitor(NumericsConfig(stats_freq=1), [nn.Sequential(toy)], str(tmp_path))
    try:
        mon.begin_step(1)
        loss = toy(x).square().mean()
        loss.backward()
        assert mon.after_microbatch(loss.detach()) is None
        mon.flush(None)
        amax = toy.weight.detach().abs().max().item()
        with torch.no_grad():
            toy.weight[3, 5] = float("nan")
        mon.begin_step(2)
        loss = toy(x).square().mean()
        loss.backward()
        ev = mon.after_microbatch(loss.detach())
    finally:
        mon.close()
    rows = [json.loads(line) for line in (tmp_path / "numerics.jsonl").read_text().splitlines()]
    assert {r["layer"] for r in rows} == {"toy.gemm"} and len(rows) == 6  # every role of its three GEMMs
    w = next(r for r in rows if r["role"] == "forward.weight")
    assert w["amax"] == pytest.approx(amax) and w["sqnr_db"] > 25  # MXFP8 e4m3 on the weight
    assert (ev.step, ev.module, ev.role) == (2, "toy.gemm", "forward.weight")
