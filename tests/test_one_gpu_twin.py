"""The 8B one-GPU preset's debug-size twin keeps the 8B preset's training state, saved-activation rules,
activation checkpointing and compile (issue 39; docs/memory.md, "Llama 3 8B on one GPU"): its 200-step losses
stand for the 8B preset's recipe only while these are the same. Reads the two TOML files; trains nothing."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EIGHT_B = REPO / "train_configs" / "llama3_8b_one_gpu.toml"
TWIN = REPO / "train_configs" / "debug_one_gpu_twin.toml"
MAY_DIFFER = {"lr"}
"""Optimizer kwargs the twin may set otherwise (the debug model trains at its own learning rate)."""


def _recipe(path: Path) -> dict:
    """What the twin must share: state formats (dtype, optimizer and its kwargs but the lr), the saved rules,
    the AC policy (top-level key and any [activation_checkpoint] table), compile, gradient clipping."""
    data = tomllib.loads(path.read_text())
    groups = [
        {**g, "optimizer_kwargs": {k: v for k, v in g["optimizer_kwargs"].items() if k not in MAY_DIFFER}}
        for g in data["optimizer"]["param_groups"]
    ]
    training = data.get("training", {})
    return {
        "dtype": training.get("dtype", "float32"),
        "max_norm": training.get("max_norm"),
        "param_groups": groups,
        "optimizer": {k: v for k, v in data["optimizer"].items() if k != "param_groups"},
        "quantize": data.get("quantize"),
        "activation_checkpoint": data.get("activation_checkpoint"),
        "compile": data.get("compile"),
        "parallelism": {k: v for k, v in data.get("parallelism", {}).items() if "parallel" in k},
    }


def test_the_twin_has_the_8b_presets_state_saved_rules_and_ac():
    eight_b, twin = _recipe(EIGHT_B), _recipe(TWIN)
    assert eight_b["quantize"] and eight_b["activation_checkpoint"]  # the comparison compares something
    assert eight_b["param_groups"][0]["optimizer_kwargs"]["exp_avg"]
    for key in eight_b:
        assert twin[key] == eight_b[key], key


def test_the_twin_is_the_debug_model_and_seeded():
    data = tomllib.loads(TWIN.read_text())
    assert data["job"]["base"] == "llama3:llama3_debugmodel"
    assert data["debug"]["seed"] == 0
    assert "llama3_8b_one_gpu.toml" in TWIN.read_text().split("\n", 1)[0]  # the header says whose twin it is
