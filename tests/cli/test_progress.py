"""The sweep progress display: time left from points done (the running one by its steps), the running point's
step and loss read from its folder, plain lines when not on a terminal."""

from __future__ import annotations

import io
import json
import math

from rich.console import Console

from low_bits_training.cli.progress import SweepProgress, clock, eta_seconds
from low_bits_training.run.folder import read_last_row, read_total_steps


def test_eta_and_clock():
    assert eta_seconds(100.0, 1.0, 4) == 300.0
    assert eta_seconds(90.0, 1.5, 4) == 150.0  # the running point half done counts as half a point
    assert math.isnan(eta_seconds(5.0, 0.0, 4))
    assert clock(3725.4) == "1:02:05" and clock(math.nan) == "-"


def test_last_row_skips_a_torn_line(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2, "loss": 7.5}) + '\n{"step": 3, "lo')
    assert read_last_row(f) == {"step": 2, "loss": 7.5}
    assert read_last_row(tmp_path / "none.jsonl") is None
    assert read_last_row(f, tail=45) == {"step": 2, "loss": 7.5}  # the first row cut by the tail


def test_display_follows_the_running_point(tmp_path):
    out = io.StringIO()
    progress = SweepProgress(2, console=Console(file=out, force_terminal=False, width=120))
    folder = tmp_path / "p1"
    folder.mkdir()
    with progress:
        progress.start("recipe-bf16", folder, "--quantize.recipe bf16")
        (folder / "config.json").write_text(json.dumps({"training": {"steps": 10}}))
        (folder / "metrics.jsonl").write_text(
            json.dumps({"step": 5, "loss_metrics/global_avg_loss": 6.25}) + "\n"
        )
        progress.poll()
        assert (progress.step, progress.steps, progress.loss) == (5, 10, 6.25)
        assert progress.fraction() == 0.5 and read_total_steps(folder) == 10
        rendered = Console(file=io.StringIO(), width=120)
        rendered.print(progress.render())
        text = rendered.file.getvalue()
        assert "point 1/2" in text and "step 5/10" in text and "loss 6.2500" in text and "left ~" in text
        progress.finish(3)
    lines = out.getvalue().splitlines()
    assert lines[0] == "[1/2] recipe-bf16: --quantize.recipe bf16"
    assert lines[1].startswith(f"  recipe-bf16: exit code 3; log: {folder / 'train.log'}")
    assert progress.failed == 1 and progress.fraction() == 1.0


def test_sweep_and_scaling_runs_drive_the_display(tmp_path, monkeypatch, capsys):
    # lbt-sweep and lbt-scaling both run their points through sweep.run_points: each point is announced
    # i/N, polled while it trains (its step and loss) and reported when it ends.
    from low_bits_training.cli import runner, sweep
    from low_bits_training.cli.grid import Grid

    polled = []

    def fake_run(config_file, folder, args, nproc=1, timeout=None, watch=None):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({"training": {"steps": 4}}))
        row = {"step": 2, "loss_metrics/global_avg_loss": 7.0 + nproc}
        (folder / "metrics.jsonl").write_text(json.dumps(row) + "\n")
        watch()
        polled.append((nproc, SweepProgress.current.step, SweepProgress.current.loss))
        return runner.Result(folder, 0 if nproc == 1 else 3)

    monkeypatch.setattr(runner, "run_local", fake_run)
    monkeypatch.setattr(SweepProgress, "current", None, raising=False)
    real_poll = SweepProgress.poll

    def poll(self):
        SweepProgress.current = self
        real_poll(self)

    monkeypatch.setattr(SweepProgress, "poll", poll)
    grid = Grid(config_file="x.toml", name="s", grid={"nproc": [1, 2]})
    results = sweep.run_points(grid, tmp_path)
    assert [r.returncode for r in results] == [0, 3] and polled == [(1, 2, 8.0), (2, 2, 9.0)]
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("[1/2] nproc-1") and out[2].startswith("[2/2] nproc-2")
    assert out[3].startswith("  nproc-2: exit code 3; log: ")
