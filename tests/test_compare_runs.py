"""``scripts/compare_runs.py`` (issue 41's "no behaviour change" check) tells equal run folders from ones whose
losses, plan files or presence differ."""

from __future__ import annotations

import importlib.util
import json

from helpers import REPO

spec = importlib.util.spec_from_file_location("compare_runs", REPO / "scripts" / "compare_runs.py")
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)


def _run(folder, loss: float, plan: str = "plan") -> None:
    folder.mkdir(parents=True)
    rows = [
        {"step": 1, "loss_metrics/global_avg_loss": 4.0},
        {"step": 2, "loss_metrics/global_avg_loss": loss},
    ]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "precision_plan.txt").write_text(plan)


def test_equal_runs_pass_and_each_difference_is_named(tmp_path, capsys):
    _run(tmp_path / "a" / "p", 3.5)
    _run(tmp_path / "b" / "p", 3.5)
    assert compare.main([str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert capsys.readouterr().out == "p: equal\n"
    _run(tmp_path / "c" / "p", 3.5000001, plan="other")
    assert compare.main([str(tmp_path / "a"), str(tmp_path / "c")]) == 1
    assert (
        capsys.readouterr().out
        == "p: losses differ or none logged (2 / 2 rows); precision_plan.txt differs\n"
    )
    (tmp_path / "d").mkdir()
    assert compare.main([str(tmp_path / "a"), str(tmp_path / "d")]) == 1
    assert capsys.readouterr().out == f"p: missing in {tmp_path / 'd'}\n"
