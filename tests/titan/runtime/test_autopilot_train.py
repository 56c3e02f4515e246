"""[quantize.autopilot] through the launcher (run_llama_train.sh), as users run it.

The scenario: one role of one layer (``layers.1.feed_forward.w1`` forward.input) in an unscaled,
non-saturating e2m5 (largest finite value 3.875, then inf): its GEMM's product is non-finite at step 1.
Without the autopilot the run stops there; with it, that role (and only it) goes one rung up (e4m3) and
step 1 runs again: the losses equal, bit for bit, those of a run that had e4m3 there from the start, and a
run resumed from a checkpoint replays the decision and equals the uninterrupted one.

The spike: the final norm scales its output 30x on one call (``tests/titan/nan_override.spike_norm``), a loss
of ~92 nats at step 7 instead of ~7.4. The run rolls back in memory to the host snapshot of step 4 and runs
steps 5-7 again: with ``on_spike = "rollback"`` the losses equal a run that never spiked, bit for bit.
"""

from __future__ import annotations

import json
import math
import shutil

import pytest

from helpers import REPO, train, write_toml

MOE_TOML = REPO / "train_configs" / "debug_moe.toml"

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
    "seen": 0,
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


EXPERT = "layers.1.moe.routed_experts.inner_experts.w1"


def test_an_expert_weight_is_promoted_as_a_linear_layer_is(tmp_path):
    """The MoE preset with its layer-1 experts' w1 input in the overflowing e2m5: the autopilot promotes
    that role of that expert weight alone and runs step 1 again, which must not count the dropped attempt's
    routing in the load-balancing bias (``titan.targets.experts.zero_expert_counts``): the losses equal a run with
    e4m3 there from the start, bit for bit."""
    rule = {"layers": [EXPERT], "roles": ["forward.input"], "scaling": "none", "saturate": False}

    def config(fmt, name, **pilot):
        quantize = {"recipe": "bf16", "rules": [{**rule, "format": fmt}], "autopilot": pilot}
        return write_toml(tmp_path / name, base=MOE_TOML, quantize=quantize)

    steps = ("--training.steps", "3", "--checkpoint.no-enable")
    ref = _run(tmp_path / "ref", *steps, config=config("e4m3", "ref.toml", enable=False))
    pilot = config("e2m5", "pilot.toml", enable=True, ladder=["e2m5", "e4m3", "high"])
    run = _run(tmp_path / "run", *steps, config=pilot)
    assert run.losses == ref.losses and sorted(run.losses) == [1, 2, 3]  # bit for bit
    assert _decisions(run) == [{**STEP1, "layer": EXPERT}]


def test_the_documented_nvfp4_ladder_promotes_nothing_on_ordinary_data(tmp_path):
    """docs/numerics.md's example (recipe nvfp4, ladder nvfp4 -> mxfp8 -> high, default triggers): a few
    percent of every NVFP4 role read as ``saturation`` (a rounded ue4m3 block scale lifts a block's largest
    value just past 6), which promoted all 60 roles at step 1; the trigger reads ``clipping``: none."""
    pilot = {"enable": True, "ladder": ["nvfp4", "mxfp8", "high"]}
    config = write_toml(tmp_path / "nvfp4.toml", quantize={"recipe": "nvfp4", "autopilot": pilot})
    run = _run(tmp_path / "run", "--training.steps", "1", "--checkpoint.no-enable", config=config)
    rows = [json.loads(x) for x in (run.folder / "numerics.jsonl").read_text().splitlines()]
    assert len(rows) == 180 and max(r["saturation"] for r in rows) > 0.02
    assert max(r["clipping"] for r in rows) < 0.001
    assert _decisions(run) == [] and "watches 30 quantized targets" in run.log


PRODUCT = "layers.1.attention.qk"
DS = {"layers": [PRODUCT], "roles": ["dgrad.grad_output", "wgrad.grad_output"]}


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_an_attention_product_is_promoted_as_a_phase_would_switch_it(tmp_path, compiled):
    """Attention products switch plans mid-run: Q K^T's gradient dS (both GEMMs that read it) in an unscaled
    e2m5 underflows entirely; the statistics of step 1 promote those two roles to high precision from step
    2, and the losses equal, bit for bit, a run whose plan a phase switches the same way at step 2 (compiled:
    one more graph for the new block plan); without the autopilot step 3 differs."""

    def config(name, **quantize):
        rule = {**DS, "format": "e2m5", "scaling": "none"}
        return write_toml(tmp_path / name, quantize={"recipe": "bf16", "rules": [rule], **quantize})

    steps = ("--training.steps", "3", "--checkpoint.no-enable", *(["--compile.enable"] * compiled))
    later = [{"start": 1, "rules": [{**DS, "format": "high"}]}]
    phase = _run(tmp_path / "phase", *steps, config=config("phase.toml", phases=later))
    run = _run(tmp_path / "run", *steps, config=config("pilot.toml", autopilot={"enable": True}))
    assert run.losses == phase.losses and sorted(run.losses) == [1, 2, 3]  # bit for bit
    assert [(d["step"], d["layer"], d["role"], d["trigger"], d["after"]) for d in _decisions(run)] == [
        (1, PRODUCT, "dgrad.grad_output", "underflow", "high"),
        (1, PRODUCT, "wgrad.grad_output", "underflow", "high"),
    ]
    assert "watches 1 quantized targets (of 2 that can switch plans" in run.log
    if not compiled:
        kept = _run(tmp_path / "kept", *steps, config=config("kept.toml"))
        assert kept.losses[3] != run.losses[3], (kept.losses, run.losses)


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


LOSS = "loss_metrics/global_avg_loss"
SPIKE = ("--override.imports", "tests.titan.nan_override.spike_norm", "--training.steps", "9")
SPIKE_ENV = {"LBT_TEST_SPIKE_CALL": "7"}  # one forward per step: step 7
SPIKE_PILOT = {"spike_z": 50.0, "spike_window": 4, "snapshot_every": 2, "ladder": ["high"]}


def _spike_config(tmp_path, recipe="bf16", **pilot):
    autopilot = {"enable": True, **SPIKE_PILOT, **pilot}
    return write_toml(tmp_path / "spike.toml", quantize={"recipe": recipe, "autopilot": autopilot})


def test_a_spike_rolls_back_to_a_host_snapshot_and_replays_bit_for_bit(tmp_path):
    """Compiled (the restore writes the tensors the graphs hold in place: no recompile)."""
    cfg = _spike_config(tmp_path, on_spike="rollback")
    args = (*SPIKE, "--checkpoint.no-enable", "--compile.enable")
    clean = _run(tmp_path / "clean", *args, config=cfg)
    spiked = train(tmp_path / "spiked", *SEED, *args, config=cfg, env=SPIKE_ENV)
    assert _decisions(clean) == []
    (d,) = _decisions(spiked)
    assert (d["step"], d["seen"], d["layer"], d["trigger"]) == (5, 7, "", "loss_spike") and d["value"] > 50
    assert "spike at step 7: rolled back to step 4" in spiked.log
    lines = [json.loads(x) for x in (spiked.folder / "metrics.jsonl").read_text().splitlines()]
    step7 = [r[LOSS] for r in lines if r["step"] == 7 and LOSS in r]
    assert step7[0] > 50 and step7[1] == clean.losses[7]  # the spike, then its replay (the later row wins)
    assert spiked.losses == clean.losses and sorted(spiked.losses) == list(range(1, 10))  # bit for bit
    assert [(r["step"], r["autopilot/rollbacks"]) for r in spiked.rows if "autopilot/rollbacks" in r] == [
        (5, 1.0)
    ]


def test_a_spike_promotes_the_worst_role_on_two_ranks(tmp_path):
    """mxfp8 (statistics at step 1 name the suspect), 2 FSDP2 ranks: one decision, on every rank."""
    args = (*SPIKE, "--checkpoint.no-enable", "--parallelism.data_parallel_shard_degree", "2")
    cfg = _spike_config(tmp_path, recipe="mxfp8", saturation=0.0, underflow=0.0)
    env = {**SPIKE_ENV, "LOG_RANK": "0,1"}
    run = train(tmp_path / "run", *SEED, *args, config=cfg, nproc=2, env=env, timeout=1800)
    (d,) = _decisions(run)
    assert (d["step"], d["seen"], d["trigger"], d["after"], d["rung"]) == (5, 7, "loss_spike", "high", "high")
    assert d["layer"].startswith("layers.") and d["before"].startswith("e4m3/block32")
    assert sorted(run.losses) == list(range(1, 10)) and max(run.losses.values()) < 9  # the spike is gone
    said = [ln for ln in run.log.splitlines() if "spike at step 7: rolled back to step 4" in ln]
    assert sorted(ln.split("]")[0] for ln in said) == ["[rank0", "[rank1"]
