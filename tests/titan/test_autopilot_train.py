"""[quantize.autopilot] through the launcher (run_llama_train.sh), as users run it.

The scenario: one role of one layer (``layers.1.feed_forward.w1`` forward.input) in an unscaled,
non-saturating e2m5 (largest finite value 3.875, then inf): its GEMM's product is non-finite at step 1.
Without the autopilot the run stops there; with it, that role (and only it) goes one rung up (e4m3) and
step 1 runs again: the losses equal, bit for bit, those of a run that had e4m3 there from the start, and a
run resumed from a checkpoint replays the decision and equals the uninterrupted one.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest

from helpers import train, write_toml

LAYER = "layers.1.feed_forward.w1"
SEED = ("--debug.seed", "0")


def _config(tmp_path, fmt="e2m5", name="pilot.toml", recipe="bf16", numerics="warn", **pilot):
    rule = {
        "layers": [LAYER],
        "roles": ["forward.input"],
        "format": fmt,
        "scaling": "none",
        "saturate": False,
    }
    autopilot = {"enable": True, "ladder": ["e2m5", "e4m3", "high"], **pilot}
    quantize = {"recipe": recipe, "rules": [rule], "autopilot": autopilot}
    return write_toml(tmp_path / name, quantize=quantize, numerics={"nonfinite": numerics})


def _run(folder, *args, config, nproc=1, check=True, timeout=600):
    folder.mkdir(parents=True, exist_ok=True)
    env = {"LOG_RANK": ",".join(map(str, range(nproc)))}  # every rank's console lines
    return train(folder, *SEED, *args, config=config, nproc=nproc, check=check, timeout=timeout, env=env)


def _decisions(run) -> list[dict]:
    path = run.folder / "autopilot.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


STEP1 = {
    "step": 1,
    "layer": LAYER,
    "role": "forward.input",
    "trigger": "nonfinite",
    "value": "forward.output",
    "before": "e2m5/none/rne/nosat",
    "after": "e4m3/none/rne/nosat",
    "rung": "e4m3",
}


def test_a_nan_is_healed_in_its_step_and_a_resume_replays_the_decision(tmp_path):
    steps = ("--training.steps", "4")
    stopped = _run(
        tmp_path / "off", *steps, config=_config(tmp_path, numerics="stop", enable=False), check=False
    )
    assert stopped.returncode == 3  # numerics.nonfinite = "stop": the launcher's non-finite exit
    assert f"module {LAYER}, role forward.output" in stopped.log
    ref = _run(
        tmp_path / "ref", *steps, "--checkpoint.no-enable", config=_config(tmp_path, "e4m3", "ref.toml")
    )
    cfg = _config(tmp_path)
    whole = _run(tmp_path / "whole", *steps, "--checkpoint.interval", "2", config=cfg)
    assert whole.losses == ref.losses and sorted(whole.losses) == [1, 2, 3, 4]  # bit for bit
    assert _decisions(whole) == [STEP1]
    assert [(r["step"], r["autopilot/promotions"]) for r in whole.rows if "autopilot/promotions" in r] == [
        (1, 1.0)
    ]
    assert f"autopilot: step 1: {LAYER} forward.input e2m5/none/rne/nosat -> e4m3/none/rne/nosat" in whole.log
    resumed_folder = tmp_path / "resumed" / "run"
    shutil.copytree(whole.folder / "checkpoint" / "step-2", resumed_folder / "checkpoint" / "step-2")
    shutil.copy(whole.folder / "autopilot.jsonl", resumed_folder / "autopilot.jsonl")
    resumed = _run(tmp_path / "resumed", *steps, "--checkpoint.interval", "2", config=cfg)
    assert "Training starts at step 3" in resumed.log and "autopilot: replayed 1 decisions" in resumed.log
    assert {s: resumed.losses[s] for s in (3, 4)} == {s: whole.losses[s] for s in (3, 4)}
    assert _decisions(resumed) == [STEP1]


@pytest.mark.parametrize("nproc", [1, 2])
def test_the_same_decision_compiled_and_on_every_rank_of_two(tmp_path, nproc):
    """1 rank compiled (the promotion compiles the block's new plan once); 2 FSDP2 ranks eager, where the
    other layers run mxfp8 with the default statistic triggers on (step 1 is a statistics step): they are
    never promoted."""
    args = ("--training.steps", "3", "--checkpoint.no-enable")
    args += ("--compile.enable",) if nproc == 1 else ("--parallelism.data_parallel_shard_degree", "2")
    cfg = _config(tmp_path, recipe="bf16" if nproc == 1 else "mxfp8")
    run = _run(tmp_path / "run", *args, config=cfg, nproc=nproc, timeout=1800)
    assert sorted(run.losses) == [1, 2, 3] and all(math.isfinite(v) for v in run.losses.values())
    assert _decisions(run) == [STEP1]
    said = [ln for ln in run.log.splitlines() if f"autopilot: step 1: {LAYER} forward.input" in ln]
    assert sorted(ln.split("]")[0] for ln in said) == [f"[rank{r}" for r in range(nproc)]  # every rank


@pytest.mark.parametrize(
    ("pilot", "numerics", "message"),
    [
        (
            {"ladder": ["e4m3", "fp9"]},
            "warn",
            "quantize.autopilot.ladder[1] = 'fp9': expected 'high', a recipe",
        ),
        (
            {},
            "off",
            "quantize.autopilot.nonfinite = true reads the layers' NaN flags: set numerics.nonfinite",
        ),
    ],
)
def test_bad_autopilot_keys_are_one_line_and_exit_2(tmp_path, pilot, numerics, message):
    folder = tmp_path / "bad"
    folder.mkdir()
    run = _run(folder, config=_config(tmp_path, numerics=numerics, **pilot), check=False)
    assert run.returncode == 2
    lines = [ln for ln in run.log.splitlines() if "quantize.autopilot" in ln]
    assert lines and message in lines[0]
    assert not (folder / "run").exists()
