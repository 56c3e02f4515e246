"""lbt-sweep and lbt-scaling: a real two-point sweep of the debug model on CPU (1 and 2 processes), the table,
the CSV and the plot from it, and the grid / table logic on hand-made metrics files."""

from __future__ import annotations

import csv
import json
import math
import os
import sys
from pathlib import Path

import pytest

from helpers import CORPUS
from low_bits_training.cli import grid as grid_mod
from low_bits_training.cli import scaling, sweep
from low_bits_training.cli.grid import Grid, load_grid, override
from low_bits_training.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
DEBUG = str(REPO / "train_configs" / "debug_model.toml")
SMALL = [
    "--training.local_batch_size",
    "2",
    "--training.seq_len",
    "128",
    "--metrics.log_freq",
    "1",
    "--metrics.no-enable-tensorboard",
    "--checkpoint.no-enable",
    "--training.steps",
    "3",
    "--dataloader.dataset_path",
    str(CORPUS),
]


@pytest.fixture(scope="module")
def real_sweep(tmp_path_factory):
    """One real sweep: nproc = 1, 2 (the only trainings of this file; ~1 minute on 2 cores)."""
    out = tmp_path_factory.mktemp("sweeps")
    code = sweep.main(
        ["--config-file", DEBUG, "--name", "ranks", "--out", str(out), "--grid", "nproc=1,2", "--", *SMALL]
    )
    return code, out / "ranks"


def test_real_sweep_writes_table_csv_and_plot(real_sweep):
    code, folder = real_sweep
    logs = {
        p.name: (p / "train.log").read_text()[-3000:] for p in folder.iterdir() if (p / "train.log").exists()
    }
    assert code == 0, logs
    assert sorted(p.name for p in folder.iterdir()) == [
        "loss.png",
        "nproc-1",
        "nproc-2",
        "summary.csv",
        "summary.md",
    ]
    command = (folder / "nproc-2" / "command.txt").read_text()
    assert f"--dump_folder {folder / 'nproc-2'}" in command and "--training.steps 3" in command
    with open(folder / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["config"], r["nproc"], r["runs"]) for r in rows] == [
        ("base (baseline)", "1", "1/1"),
        ("base", "2", "1/1"),
    ]
    for r in rows:
        assert r["final step"] == "3/3"  # the loss of the run's last step
        final = float(r["final loss"].split(" ± ")[0])
        assert 7.0 < final < 8.3  # ~log(2048) falling after 3 steps
        assert float(r["tok/s/proc"]) > 0 and float(r["peak GiB"]) > 0
    assert math.isclose(
        float(rows[1]["tok/s total"]), 2 * float(rows[1]["tok/s/proc"]), rel_tol=0.01, abs_tol=2
    )  # both columns are rounded to whole tok/s
    assert "| final loss |" in (folder / "summary.md").read_text()
    png = (folder / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_scaling_table_from_the_same_runs(real_sweep, capsys):
    _, folder = real_sweep
    code = scaling.main(
        [
            "--config-file",
            DEBUG,
            "--nproc",
            "1,2",
            "--name",
            folder.name,
            "--out",
            str(folder.parent),
            "--collect",
        ]
    )
    text = capsys.readouterr().out
    assert code == 0
    lines = [line for line in text.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert len(lines) == 2 and lines[0].split("|")[4].strip() == "1.00x"
    assert "2 processes:" in text and "scaling efficiency" in text
    assert (folder / "scaling.md").is_file() and (folder / "scaling.csv").is_file()


def write_run(folder: Path, losses: list[float], tps: float = 100.0, mem: float = 1.0) -> None:
    folder.mkdir(parents=True)
    rows = [
        {
            "step": i + 1,
            "loss_metrics/global_avg_loss": v,
            "throughput(tps)": tps if i else 1.0,
            "memory/max_reserved(GiB)": mem,
        }
        for i, v in enumerate(losses)
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_seeds_pool_into_mean_std_and_paired_delta(tmp_path):
    g = Grid(
        config_file=DEBUG,
        name="prec",
        grid={"quantize.recipe": ["bf16", "fp8_rowwise"], "debug.seed": [0, 1]},
        baseline={"quantize.recipe": "bf16"},
    )
    assert [p.name for p in g.points()] == [
        "recipe-bf16_seed-0",
        "recipe-bf16_seed-1",
        "recipe-fp8_rowwise_seed-0",
        "recipe-fp8_rowwise_seed-1",
    ]
    assert g.points()[3].args == ("--quantize.recipe", "fp8_rowwise", "--debug.seed", "1")
    write_run(tmp_path / "recipe-bf16_seed-0", [8.0, 7.0, 7.2], tps=200)
    write_run(tmp_path / "recipe-bf16_seed-1", [8.0, 7.1, 7.4], tps=100)
    write_run(tmp_path / "recipe-fp8_rowwise_seed-0", [8.0, 7.3, 7.3], mem=2.5)
    # seed 1 of fp8 failed: no metrics
    sweep.report(g, tmp_path)
    with open(tmp_path / "summary.csv") as f:
        base, fp8 = csv.DictReader(f)
    assert base["config"] == "quantize.recipe=bf16 (baseline)" and base["runs"] == "2/2"
    assert base["final loss"] == f"7.3000 ± {math.sqrt(0.02):.4f}" and base["best loss"] == "7.0500 ± 0.0707"
    assert base["tok/s/proc"] == "150"  # the first step (warm-up) left out
    assert base["final step"] == "3"  # no config.json: the total is unknown
    assert (
        fp8["runs"] == "1/2" and fp8["Δ final vs baseline"] == "0.1000 ± 0.0000"
    )  # paired with seed 0: 7.3 - 7.2
    assert fp8["peak GiB"] == "2.50"
    assert (tmp_path / "loss.png").stat().st_size > 10_000


def test_scaling_verdict():
    run = lambda tps: scaling.RunStats({1: 8.0}, tps, 1.0, final=8.0, last_step=1, total_steps=1)  # noqa: E731
    assert scaling.verdict({1: run(100), 2: run(90)}).endswith(
        "(90% scaling efficiency): more processes made training faster"
    )
    assert "NOT faster" in scaling.verdict({1: run(100), 2: run(40)})
    assert "superlinear" in scaling.verdict({1: run(50), 2: run(300)})
    assert scaling.verdict({1: run(100), 2: None}).startswith("fewer than two")
    assert scaling.scaling_cells({1: run(100), 2: run(90)})[1] == (
        "2",
        "90",
        "180",
        "1.80x",
        "90%",
        "1/1",
        "8.0000",
        "1.00",
    )


def test_grid_file_and_cli(tmp_path):
    f = tmp_path / "g.toml"
    f.write_text(
        'config_file = "x.toml"\nname = "p"\nargs = ["--training.steps", "5"]\n'
        '[grid]\n"quantize.recipe" = ["bf16", "mxfp8"]\n"debug.seed" = [0]\n'
    )
    g = load_grid(str(f), grid=["debug.seed=1,2", "optimizer.lr=3e-4"], args=["--x.y", "1"])
    assert g.grid == {"quantize.recipe": ["bf16", "mxfp8"], "debug.seed": [1, 2], "optimizer.lr": [3e-4]}
    assert g.args == ("--training.steps", "5", "--x.y", "1") and g.config_file == "x.toml"
    assert override("checkpoint.enable", False) == ["--checkpoint.no-enable"]
    assert override("compile.enable", True) == ["--compile.enable"]
    f.write_text('config_file = "x.toml"\nrecipes = [1]\n')
    with pytest.raises(ConfigError, match="unknown key 'recipes'; allowed: config_file"):
        load_grid(str(f))
    with pytest.raises(ConfigError, match="grid.debug.seed = \\[\\]"):
        Grid(config_file="x", grid={"debug.seed": []})
    with pytest.raises(ConfigError, match="baseline key 'quantize.recipe': not a grid key"):
        Grid(config_file="x", grid={"debug.seed": [0]}, baseline={"quantize.recipe": "bf16"})
    with pytest.raises(ConfigError, match="--grid 'debug.seed'"):
        grid_mod.parse_pairs(["debug.seed"], "--grid")


def test_sweep_submits_each_point_through_submit_sh(tmp_path, monkeypatch, capsys):
    (tmp_path / "bin").mkdir()
    fake = tmp_path / "bin" / "sbatch"
    fake.write_text(
        '#!/usr/bin/env bash\nprintf \'%s|%s|%s\\n\' "$LBT_RUN_NAME" "$LBT_DUMP_FOLDER" "$*" >> '
        f"{tmp_path}/sbatch.log\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("PYTHON", sys.executable)
    monkeypatch.setenv("ENV_FILE", str(tmp_path / "none.env"))
    code = sweep.main(
        [
            "--config-file",
            DEBUG,
            "--name",
            "s",
            "--out",
            str(tmp_path / "o"),
            "--grid",
            "debug.seed=0,1",
            "--slurm",
            "--",
            "--training.steps",
            "7",
            "--dataloader.dataset_path",  # submit.sh's check builds the corpus: not in the checkout
            str(CORPUS),
        ]
    )
    assert code == 0 and "--collect" in capsys.readouterr().out
    calls = [line.split("|") for line in (tmp_path / "sbatch.log").read_text().splitlines()]
    assert [c[:2] for c in calls] == [
        ["seed-0", str(tmp_path / "o" / "s" / "seed-0")],
        ["seed-1", str(tmp_path / "o" / "s" / "seed-1")],
    ]
    assert calls[1][2].endswith(
        f"scripts/slurm/train.sbatch --training.steps 7 --dataloader.dataset_path {CORPUS} --debug.seed 1"
    )
    assert "--gpus-per-node=1" in calls[0][2]
