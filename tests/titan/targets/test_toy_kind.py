"""Adding a kind of plan target is one ``TargetKind`` plus one line of ``registry.TARGETS`` (issue 41): a toy
kind registered here (one GEMM entry, ``toy.gemm``, its own module label) is resolved with the recipe, listed
by the plan table and its saved files, counted by lbt-doctor's backend row, and its FLOPs reach the report's
share of GEMM FLOPs per format. Nothing outside the registry names the kinds
(``test_targets.test_no_other_module_enumerates_the_kinds``). The numerics monitor loops over the live
``QuantState`` modules of the model, whatever their kind (``nn.state.live_targets``): a kind's module that
carries one is monitored; this toy has no module, so the monitor is not part of this test."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import DEBUG_TOML
from low_bits_training.cli.plan_checks import check_backends
from low_bits_training.nn.hardware import Hardware
from low_bits_training.plan.resolve import LayerShape
from low_bits_training.report.runs import LOSS, RunData, flop_shares
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
