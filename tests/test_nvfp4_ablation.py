"""benchmarks/nvfp4_ablation.py --collect: the plot goes under --out (never over the committed figure), and an
empty collection is reported, not plotted."""

from __future__ import annotations

import hashlib
import importlib.util
import json

import pytest

from helpers import REPO

FIGURE = REPO / "docs" / "img" / "nvfp4_ablation.png"


@pytest.fixture(scope="module")
def ablation():
    spec = importlib.util.spec_from_file_location("nvfp4_ablation", REPO / "benchmarks" / "nvfp4_ablation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fake_run(folder, losses):
    folder.mkdir(parents=True)
    rows = [
        {"step": s, "loss_metrics/global_avg_loss": v, "throughput(tps)": 100.0} for s, v in losses.items()
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_empty_collection_writes_nothing_and_says_so(ablation, tmp_path, capsys):
    before = _digest(FIGURE)
    code = ablation.main(["--out", str(tmp_path / "runs"), "--collect", "--steps", "3"])
    assert code == 1
    assert "no run under" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()  # no summary, no plot
    assert _digest(FIGURE) == before


def test_plot_goes_under_out_unless_plot_says_otherwise(ablation, tmp_path):
    before = _digest(FIGURE)
    out = tmp_path / "runs"
    args = ["--out", str(out), "--collect", "--steps", "3", "--seeds", "0", "--recipes", "bf16,nvfp4"]
    _fake_run(out / "recipe-bf16", {1: 8.0, 2: 7.0, 3: 6.0})
    _fake_run(out / "recipe-nvfp4", {1: 8.0, 2: 7.1, 3: 6.2})
    assert ablation.main([*args, "--window", "2"]) == 0
    assert (out / "nvfp4_ablation.png").read_bytes()[:4] == b"\x89PNG"
    assert "| nvfp4 | 1/1 | 6.2000 ± 0.0000 | +0.2000 ± 0.0000 |" in (out / "summary.md").read_text()
    assert ablation.main([*args, "--window", "2", "--plot", str(tmp_path / "elsewhere.png")]) == 0
    assert (tmp_path / "elsewhere.png").is_file()
    assert _digest(FIGURE) == before
