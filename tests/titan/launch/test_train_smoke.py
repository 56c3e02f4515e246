"""Real training runs through torchrun on CPU ranks: the loss falls, parallelisms train, a run resumes."""

import json

import pytest

from helpers import REPO, train


def test_one_rank_trains_and_writes_its_folder(tmp_path):
    run = train(
        tmp_path, "--training.steps", "12", "--training.local_batch_size", "4", "--checkpoint.interval", "6"
    )
    loss = run.losses
    assert sorted(loss) == list(range(1, 13))
    assert 7.5 < loss[1] < 8.5  # ~log(2048): an untrained model over the debug model's vocabulary
    assert loss[12] < loss[1] - 1.0, loss
    assert (run.folder / "config.toml").is_file() and (run.folder / "command.txt").is_file()
    assert sorted(p.name for p in (run.folder / "checkpoint").iterdir()) == ["step-12", "step-6"]
    assert "low-bits-training: config error" not in run.log


@pytest.mark.parametrize(
    "preset, args",
    [
        ("debug_model.toml", ("--parallelism.data_parallel_shard_degree", "2")),
        ("debug_model_tp2.toml", ()),
        ("debug_model_pp2.toml", ()),
    ],
    ids=["fsdp2", "tp2", "pp2"],
)
def test_two_ranks_train(tmp_path, preset, args):
    run = train(tmp_path, "--training.steps", "6", *args, nproc=2, config=REPO / "train_configs" / preset)
    loss = run.losses
    assert sorted(loss) == list(range(1, 7))
    assert loss[6] < loss[1] - 0.2, loss


def test_a_checkpoint_is_resumed_with_the_step_count_continuing(tmp_path):
    first = train(tmp_path, "--training.steps", "4", "--checkpoint.interval", "2")
    assert sorted(first.losses) == [1, 2, 3, 4]
    second = train(tmp_path, "--training.steps", "6", "--checkpoint.interval", "2")
    assert "Training starts at step 5" in second.log
    lines = [json.loads(x) for x in (second.folder / "metrics.jsonl").read_text().splitlines()]
    # Training rows (those with a loss): the second run appended steps 5 and 6 only. Other rows of a step
    # (the state byte budget at a process's first step, saved bytes) are separate lines of the same step.
    rows = [r for r in lines if "loss_metrics/global_avg_loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert rows[5]["loss_metrics/global_avg_loss"] < rows[0]["loss_metrics/global_avg_loss"]
