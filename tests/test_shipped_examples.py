"""The examples the docs run are shipped and reproducible: the sweep grid file (sweeps/) says what the docs
show, and the low-bit optimizer preset is seeded like every debug preset (docs/reliability.md)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from low_bits_training.cli.grid import load_grid

REPO = Path(__file__).resolve().parents[1]


def test_the_documented_precision_grid_is_the_shipped_one():
    text = (REPO / "docs" / "experiments.md").read_text()
    block = re.search(r"## Sweeps: `lbt-sweep`.*?```toml\n(.*?)```", text, re.S).group(1)
    shipped = REPO / "sweeps" / "precision.toml"
    assert tomllib.loads(shipped.read_text()) == tomllib.loads(block)
    grid = load_grid(str(shipped))
    assert len(grid.points()) == 9 and (REPO / grid.config_file).is_file()


def test_the_optimizer_presets_are_the_debug_model_with_their_optimizer():
    """Seeded like every debug preset, and otherwise the debug model, so their losses compare step for step
    with docs/optimizers.md's table (benchmarks/optim_losses.py replaces the debug model's optimizer)."""

    def rest(path):
        data = tomllib.loads(path.read_text())
        data.pop("optimizer")
        data["job"] = {k: v for k, v in data["job"].items() if k == "base"}
        return data

    presets = sorted((REPO / "train_configs" / "optim").glob("*.toml"))
    base = rest(REPO / "train_configs" / "debug_model.toml")
    assert presets and base["debug"]["seed"] == 0 and all(rest(p) == base for p in presets)


def test_the_profiling_preset_writes_one_trace_window():
    """torch's profiler dumps a window at its end (RECORD_AND_SAVE) and, at exit, whatever a cycle is still
    recording: with a second cycle under way at the last step the preset wrote a stray ``iteration_8``."""
    from torch.profiler import ProfilerAction, schedule

    preset = tomllib.loads((REPO / "train_configs" / "debug_model_profiling.toml").read_text())
    p, steps = preset["profiler"], preset["training"]["steps"]
    wait = p["profile_freq"] - p["profiler_warmup"] - p["profiler_active"]
    action = schedule(wait=wait, warmup=p["profiler_warmup"], active=p["profiler_active"],
                      repeat=p.get("profiler_repeat", 0))  # fmt: skip
    # torchtitan steps the profiler once per training step: profiler step N ends training step N + 1
    assert [n + 1 for n in range(steps) if action(n) == ProfilerAction.RECORD_AND_SAVE] == [5]
    assert action(steps) == ProfilerAction.NONE  # nothing recording when the run ends
