"""Issue 8: killed runs resume from their last complete checkpoint, exactly; damaged or foreign checkpoints
are refused with the reason; same seed, same losses."""

import json
import math
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import REPO, train, train_command, train_env, write_toml

# Quantized layers (mxfp8, weight-gradient operands stochastically rounded) and a low-bit optimizer (int8 /
# fp8 states, bf16 master weights with stochastic rounding): every random draw must resume exactly.
LOW_BIT = {
    "quantize": {"recipe": "mxfp8", "rules": [{"layers": ["*"], "roles": ["wgrad.*"], "rounding": "stochastic"}]},
    "optimizer": {"param_groups": [{"pattern": ".*", "optimizer_name": "LowBitAdamW", "optimizer_kwargs": {
        "lr": 3e-3, "weight_decay": 0.1, "exp_avg": "int8_block128", "exp_avg_sq": "e4m3_block128",
        "master_weights": "bf16", "master_rounding": "stochastic"}}]},
}  # fmt: skip
ARGS = ("--training.steps", "6", "--checkpoint.interval", "2")


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> Path:
    return write_toml(tmp_path_factory.mktemp("cfg") / "low_bit.toml", **LOW_BIT)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cfg):
    """An uninterrupted run: the losses and checkpoints every other run is compared with."""
    return train(tmp_path_factory.mktemp("ref"), *ARGS, config=cfg)


def _kill_when(folder: Path, cfg: Path, ready, timeout: float = 300.0) -> None:
    # Start training and SIGKILL every process of it the moment ready(folder) holds.
    p = subprocess.Popen(
        train_command(folder, *ARGS),
        cwd=REPO,
        env=train_env(config=cfg),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + timeout
    try:
        while not ready(folder):
            assert p.poll() is None, "training ended before the kill point"
            assert time.monotonic() < deadline, "kill point never reached"
            time.sleep(0.002)
        for pid in [
            *_descendants(p.pid),
            p.pid,
        ]:  # the trainer ranks first: torchrun starts them in new sessions
            os.kill(pid, signal.SIGKILL)
    finally:
        p.kill()
        p.wait()


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _complete(folder: Path) -> list[int]:
    ck = folder / "checkpoint"
    return (
        sorted(int(d.name[5:]) for d in ck.glob("step-*") if (d / ".metadata").exists())
        if ck.exists()
        else []
    )


def _metrics_steps(folder: Path) -> list[int]:
    f = folder / "metrics.jsonl"
    return [json.loads(x)["step"] for x in f.read_text().splitlines()] if f.exists() else []


def _mid_step(rng):
    # After the checkpoint of step 2 and a random number of further logged steps (0-2), mid-way through a step.
    extra = rng.randint(0, 2)
    return lambda f: 2 in _complete(f) and len(_metrics_steps(f)) >= 2 + extra


def _mid_checkpoint_write(_rng):
    # While step-4 is being written: its folder exists, its .metadata does not yet.
    return lambda f: (
        (f / "checkpoint" / "step-4").is_dir() and not (f / "checkpoint" / "step-4" / ".metadata").exists()
    )


@pytest.mark.parametrize(
    "kill_point", [_mid_step, _mid_checkpoint_write], ids=["mid-step", "mid-checkpoint-write"]
)
def test_killed_run_resumes_from_last_complete_checkpoint_to_the_same_losses(
    tmp_path, cfg, reference, kill_point
):
    folder = tmp_path / "run"
    _kill_when(folder, cfg, kill_point(random.Random(os.getpid())))
    last = max(_complete(folder))
    if kill_point is _mid_checkpoint_write:
        assert (
            last == 2 and (folder / "checkpoint" / "step-4").is_dir()
        )  # the half-written one is still there
    resumed = train(tmp_path, *ARGS, config=cfg)
    assert f"Loading the checkpoint from {folder}/checkpoint/step-{last}." in resumed.log, resumed.log[-3000:]
    assert f"Training starts at step {last + 1}" in resumed.log, resumed.log[-3000:]
    assert resumed.losses == reference.losses  # to the bit: data position, RNG and optimizer state restored


def test_same_seed_same_losses(tmp_path, cfg, reference):
    again = train(tmp_path, *ARGS, config=cfg)
    assert again.losses == reference.losses


def _resume_copy(reference, tmp_path, step: int) -> Path:
    # A run folder holding only the reference's checkpoint of `step`: resuming it starts at step + 1.
    folder = tmp_path / "run"
    shutil.copytree(reference.folder / "checkpoint" / f"step-{step}", folder / "checkpoint" / f"step-{step}")
    return folder


def test_damaged_checkpoint_is_refused_with_the_reason(tmp_path, cfg, reference):
    folder = _resume_copy(reference, tmp_path, 4)
    victim = max(
        (p for p in (folder / "checkpoint" / "step-4").iterdir() if p.suffix == ".distcp"),
        key=lambda p: p.stat().st_size,
    )
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    run = train(tmp_path, *ARGS, config=cfg, check=False)
    assert run.returncode == 4  # refused by the launcher, before any rank started
    assert f"checkpoint {folder}/checkpoint/step-4 is damaged: {victim.name} has" in run.log
    assert not any("step:  5" in ln for ln in run.log.splitlines())  # nothing trained on a damaged state


def test_checkpoint_of_another_model_is_refused_with_the_reason(tmp_path, cfg, reference):
    _resume_copy(reference, tmp_path, 4)
    run = train(
        tmp_path,
        *ARGS,
        "--job.base",
        "low_bits_training.titan.launch.bases:llama3_tiny",
        config=cfg,
        check=False,
    )
    assert run.returncode == 4
    assert "belongs to another run shape (model." in run.log and "checkpoint has" in run.log


def test_checkpoint_of_another_plan_is_refused_with_the_reason(tmp_path, cfg, reference):
    _resume_copy(reference, tmp_path, 4)
    run = train(tmp_path, *ARGS, "--quantize.recipe", "fp8_rowwise", config=cfg, check=False)
    assert run.returncode == 4
    assert (
        "belongs to another run shape (quantize.recipe: checkpoint has 'mxfp8', this run has 'fp8_rowwise')"
        in run.log
    )


def test_a_checkpoint_the_ranks_cannot_load_is_one_line_and_exit_code_4(tmp_path, cfg, reference):
    # Checks off (launcher and ranks): DCP itself fails on the truncated file inside the ranks' load; the
    # launcher prints rank 0's one line and exits 4, with no torchrun traceback.
    folder = _resume_copy(reference, tmp_path, 4)
    victim = max((folder / "checkpoint" / "step-4").glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    run = train(tmp_path, *ARGS, "--checkpoint.no-verify_on_load", config=cfg, check=False)
    assert run.returncode == 4, run.log[-3000:]
    last = run.log.strip().splitlines()[-1]
    assert last.startswith(
        f"low-bits-training: checkpoint refused: checkpoint in {folder}/checkpoint cannot be loaded:"
    )
    assert "ChildFailedError" not in run.log


def test_resharded_resume_says_the_data_restarts(tmp_path, cfg, reference):
    # 1 rank wrote step 4; 2 ranks resume it. torchtitan cannot move the data position to 2 ranks: without
    # excluding it the launcher refuses (tests/test_bad_input.py), with it the run says at start that the
    # data restarts, then trains steps 5-6 from the resharded model and optimizer state.
    _resume_copy(reference, tmp_path, 4)
    run = train(tmp_path, *ARGS, "--checkpoint.exclude_from_loading", "dataloader", config=cfg, nproc=2)
    notice = (
        "(written by 1 data-parallel rank(s), checkpoint.exclude_from_loading has 'dataloader'): the data "
    )
    assert notice + "restarts from the first batch" in run.log
    assert "Training starts at step 5" in run.log
    assert sorted(run.losses) == [5, 6] and all(math.isfinite(v) for v in run.losses.values())


def test_the_lean_preset_killed_mid_step_resumes_to_the_same_losses(tmp_path):
    """bf16 parameters with LowBitAdamW's 4-bit moments and their fp32 block scales (issue 40): torch's
    optimizer load casts states to the parameter's dtype; ours keeps them as saved, so the resumed run
    equals the uninterrupted one to the bit."""
    lean = REPO / "train_configs" / "debug_lean.toml"
    reference = train(tmp_path / "ref", *ARGS, config=lean)
    folder = tmp_path / "run"
    _kill_when(folder, lean, _mid_step(random.Random(os.getpid())))
    last = max(_complete(folder))
    resumed = train(tmp_path, *ARGS, config=lean)
    assert f"Training starts at step {last + 1}" in resumed.log, resumed.log[-3000:]
    assert resumed.losses == reference.losses
