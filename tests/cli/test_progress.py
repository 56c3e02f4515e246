"""The sweep progress display: time left from points done (the running one by its steps), the running point's
step and loss read from its folder, plain lines when not on a terminal."""

from __future__ import annotations

import io
import json
import math

from rich.console import Console

from low_bits_training.cli.progress import SweepProgress, clock, eta_seconds, last_row, total_steps


def test_eta_and_clock():
    assert eta_seconds(100.0, 1.0, 4) == 300.0
    assert eta_seconds(90.0, 1.5, 4) == 150.0  # the running point half done counts as half a point
    assert math.isnan(eta_seconds(5.0, 0.0, 4))
    assert clock(3725.4) == "1:02:05" and clock(math.nan) == "-"


def test_last_row_skips_a_torn_line(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text(json.dumps({"step": 1}) + "\n" + json.dumps({"step": 2, "loss": 7.5}) + '\n{"step": 3, "lo')
    assert last_row(f) == {"step": 2, "loss": 7.5}
    assert last_row(tmp_path / "none.jsonl") is None


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
        assert progress.fraction() == 0.5 and total_steps(folder) == 10
        rendered = Console(file=io.StringIO(), width=120)
        rendered.print(progress.render())
        text = rendered.file.getvalue()
        assert "point 1/2" in text and "step 5/10" in text and "loss 6.2500" in text and "left ~" in text
        progress.finish(3)
    lines = out.getvalue().splitlines()
    assert lines[0] == "[1/2] recipe-bf16: --quantize.recipe bf16"
    assert lines[1].startswith(f"  recipe-bf16: exit code 3; log: {folder / 'train.log'}")
    assert progress.failed == 1 and progress.fraction() == 1.0
