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


def test_the_optimizer_presets_are_seeded():
    presets = sorted((REPO / "train_configs" / "optim").glob("*.toml"))
    assert presets and all(tomllib.loads(p.read_text()).get("debug", {}).get("seed") == 0 for p in presets)
