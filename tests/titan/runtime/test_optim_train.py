"""End to end: the debug model trains with LowBitAdamW through torchtitan; checkpoints resume bit-exactly
(resharding across ranks: tests/optim/test_reshard.py, real FSDP2 + DCP); bad optimizer kwargs stop the launcher with one line before any model is built."""

from __future__ import annotations

import pytest

from helpers import train, write_toml

GROUP = {
    "pattern": ".*",
    "optimizer_name": "LowBitAdamW",
    "optimizer_kwargs": {
        "lr": 3e-3,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
        "exp_avg": "int8_block128_sr",
        "exp_avg_sq": "e4m3_block128",
        "master_weights": "bf16",
        "master_rounding": "stochastic",
    },
}
# Same seed and the same LR schedule whatever --training.steps is, so a 2-step run is the first half of a 4-step one.
CKPT = (
    "--checkpoint.enable",
    "--checkpoint.interval",
    "2",
    "--debug.seed",
    "0",
    "--lr_scheduler.total_steps",
    "4",
)


def _toml(tmp_path, group=GROUP):
    return write_toml(tmp_path / "lowbit.toml", optimizer={"param_groups": [group]})


def test_interrupted_run_resumes_bit_exactly(tmp_path):
    cfg = _toml(tmp_path)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    full = train(tmp_path / "a", "--training.steps", "4", *CKPT, config=cfg).losses
    train(tmp_path / "b", "--training.steps", "2", *CKPT, config=cfg)
    resumed = train(tmp_path / "b", "--training.steps", "4", *CKPT, config=cfg).losses
    assert set(full) == {1, 2, 3, 4} and 3 in resumed and 4 in resumed
    assert resumed[3] == full[3] and resumed[4] == full[4]  # bit-exact, stochastic rounding included
    assert full[4] < full[1]


@pytest.mark.parametrize(
    ("key", "value", "expect"),
    [
        ("exp_avg", "int9_block128", "optimizer_kwargs.exp_avg='int9_block128'"),
        ("batch_numel", -1, "optimizer_kwargs.batch_numel=-1: allowed an int >= 0"),
    ],
)
def test_bad_optimizer_kwarg_is_one_line_before_the_model(tmp_path, key, value, expect):
    bad = {**GROUP, "optimizer_kwargs": {**GROUP["optimizer_kwargs"], key: value}}
    run = train(tmp_path, config=_toml(tmp_path, bad), check=False)
    assert run.returncode == 2
    line = next(ln for ln in run.log.splitlines() if "config error" in ln)
    assert f"optimizer.param_groups[0].{expect}" in line, line
    assert "Building" not in run.log and "step:" not in run.log


def test_checkpoint_of_2_fsdp_ranks_resumes_on_1(tmp_path):
    # States equal after resharding: tests/optim/test_reshard.py. Here: the trainer path end to end.
    # torchtitan's dataloader state does not reshard (it asserts the dp degree), hence exclude_from_loading.
    cfg = _toml(tmp_path)
    two = train(
        tmp_path,
        "--training.steps",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "2",
        *CKPT,
        config=cfg,
        nproc=2,
    )
    assert (two.folder / "checkpoint" / "step-2").is_dir()
    one = train(
        tmp_path,
        "--training.steps",
        "3",
        *CKPT,
        "--checkpoint.exclude_from_loading",
        "dataloader",
        config=cfg,
    )
    assert "Loading the checkpoint from" in one.log and "step-2" in one.log
    assert one.losses[3] < one.losses[1]
