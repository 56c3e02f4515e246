"""What the launcher says before torchrun starts: which rank shows the loss under pipeline parallelism, and a
finished run's one line (titan/launch/launcher.py)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from low_bits_training.titan.launch import launcher, torchrun


def _config(pp: int = 1, schedule: str = "1F1B", steps: int = 60):
    parallelism = SimpleNamespace(pipeline_parallel_degree=pp, pipeline_parallel_schedule=schedule)
    return SimpleNamespace(parallelism=parallelism, training=SimpleNamespace(steps=steps))


@pytest.mark.parametrize(
    ("nproc", "pp", "schedule", "log_rank", "shown", "env"),
    [
        (2, 2, "1F1B", None, "1", "1"),  # default: the last stage's rank instead of rank 0
        (2, 2, "1F1B", "0", "0,1", "0,1"),  # LOG_RANK=0 chosen: the loss's rank is added
        (2, 2, "1F1B", "1", "1", "1"),  # already shown: nothing said
        (4, 2, "1F1B", None, "2", "2"),  # 2 data ranks x 2 stages: the last stage starts at rank 2
        (2, 2, "ZBVZeroBubble", None, "0", "0"),  # V schedules have the loss on rank 0
        (2, 1, "1F1B", None, "0", None),  # no pipeline: untouched
    ],
)
def test_the_console_shows_the_rank_with_the_loss(monkeypatch, nproc, pp, schedule, log_rank, shown, env):
    # setenv first records the session's value (unset), so teardown also undoes what show_the_loss writes into
    # os.environ; a bare delenv of an unset name records nothing (LOG_RANK=2 leaked: later 1-rank logs empty)
    monkeypatch.setenv("LOG_RANK", "")
    monkeypatch.delenv("LOG_RANK")
    if log_rank is not None:
        monkeypatch.setenv("LOG_RANK", log_rank)
    args = torchrun.torchrun_args([f"--nproc_per_node={nproc}", "--local-ranks-filter", log_rank or "0"], [])
    line = torchrun.show_the_loss(args, _config(pp, schedule), nproc)
    assert args.local_ranks_filter == shown
    assert (line is None) == (shown == (log_rank or "0"))
    if line is not None:
        assert f"the loss is on rank {shown.split(',')[-1]}" in line and "run_train.sh" not in line
    assert os.environ.get("LOG_RANK") == env  # torchtitan's own check reads it: no hint naming run_train.sh


def test_a_finished_run_says_so_in_one_line():
    config = _config(steps=60)
    line = launcher.nothing_to_do(config, "outputs/x/checkpoint/step-60")
    assert line == (
        "low-bits-training: nothing to do: outputs/x/checkpoint/step-60 is step 60 and training.steps = 60; "
        "raise --training.steps to train on, or pick another dump_folder / [job] name to start afresh"
    )
    assert launcher.nothing_to_do(config, "outputs/x/checkpoint/step-30") is None
    assert launcher.nothing_to_do(config, None) is None


def test_an_empty_comm_traces_folder_is_removed_after_the_run(tmp_path, monkeypatch):
    from low_bits_training.titan.launch.worker import remove_empty_comm_traces

    monkeypatch.delenv("RANK", raising=False)
    config = SimpleNamespace(
        dump_folder=str(tmp_path), comm=SimpleNamespace(save_traces_folder="comm_traces")
    )
    (tmp_path / "comm_traces").mkdir()
    remove_empty_comm_traces(config)
    assert not (tmp_path / "comm_traces").exists()
    (tmp_path / "comm_traces").mkdir()
    (tmp_path / "comm_traces" / "rank_0").write_text("a flight recorder dump")  # a timeout's: kept
    remove_empty_comm_traces(config)
    assert (tmp_path / "comm_traces" / "rank_0").is_file()
    remove_empty_comm_traces(SimpleNamespace(dump_folder=str(tmp_path / "none"), comm=config.comm))
