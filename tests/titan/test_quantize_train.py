"""The precision plan in real torchtitan training on CPU ranks: TP, PP, FSDP2 + checkpoints across recipes."""

import subprocess
import sys

import pytest

from helpers import REPO, train, write_toml


def _config(tmp_path, recipe, **extra):
    return write_toml(tmp_path / f"{recipe}.toml", quantize={"recipe": recipe, **extra})


def test_bad_plan_is_a_config_error_before_the_model(tmp_path):
    cfg = _config(tmp_path, "mxfp8", rules=[{"layers": ["layers.*.attn.*"], "format": "e4m3"}])
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "low_bits_training.titan.launch",
            "--config-file",
            str(cfg),
            "--dump_folder",
            str(tmp_path / "run"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    assert (
        "low-bits-training: config error: quantize.rules[0].layers: 'layers.*.attn.*' matches no" in p.stderr
    )
    assert "Building llama3" not in p.stderr + p.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("recipe", "args"),
    [
        ("fp8_rowwise", ("--parallelism.tensor_parallel_degree", "2")),
        (
            "mxfp8",
            (
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "1F1B",
            ),
        ),
    ],
    ids=["tp2-fp8_rowwise", "pp2-mxfp8"],
)
def test_two_ranks_train_quantized(tmp_path, recipe, args):
    run = train(
        tmp_path,
        "--training.steps",
        "5",
        "--checkpoint.no-enable",
        *args,
        nproc=2,
        config=_config(tmp_path, recipe),
    )
    loss = run.losses
    assert sorted(loss) == list(range(1, 6))
    assert loss[5] < loss[1] - 0.1, loss
    table = (run.folder / "precision_plan.txt").read_text()
    assert f"recipe={recipe}" in table and "layers.[0-5].attention.qkv_linear.wqkv" in table


@pytest.mark.slow
def test_fsdp_checkpoint_bf16_to_fp8_and_back(tmp_path):
    # Switching recipe is starting a new run from a checkpoint on purpose (initial_load_path): the run-shape
    # fingerprint of titan/checkpoint.py refuses a plain resume into a different plan.
    fsdp = ("--parallelism.data_parallel_shard_degree", "2", "--checkpoint.interval", "3")
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    first = train(a, "--training.steps", "3", *fsdp, nproc=2, config=_config(tmp_path, "bf16"))
    load = ("--checkpoint.initial_load_path", str(a / "run" / "checkpoint" / "step-3"))
    fp8 = train(b, "--training.steps", "3", *fsdp, *load, nproc=2, config=_config(tmp_path, "fp8_rowwise"))
    load = ("--checkpoint.initial_load_path", str(b / "run" / "checkpoint" / "step-3"))
    back = train(c, "--training.steps", "1", *fsdp, *load, nproc=2, config=_config(tmp_path, "bf16"))
    # Continued models start where the previous run ended, not at the untrained loss (~8.05).
    assert first.losses[1] - fp8.losses[1] > 0.1, (first.losses, fp8.losses)
    assert fp8.losses[1] - back.losses[1] > 0.1, (fp8.losses, back.losses)


@pytest.mark.parametrize(
    "path",
    sorted((REPO / "train_configs").glob("recipes/debug_*.toml"))
    + sorted(p for p in (REPO / "train_configs").glob("llama3_8b_*.toml") if "profiling" not in p.stem),
    ids=lambda p: p.stem,
)
def test_presets_load_and_validate(path):
    from low_bits_training.config.plan import QuantizeConfig
    from low_bits_training.titan.configure import load_config
    from low_bits_training.titan.quantize import apply_precision_plan

    config = load_config(path, [])
    assert config.quantize != QuantizeConfig() or path.stem == "debug_bf16"
    plans = apply_precision_plan(config)
    assert plans["lm_head"].is_high_precision
    quantized = [f for f, p in plans.items() if not p.is_high_precision]
    assert (len(quantized) == 0) == (config.quantize.recipe == "bf16")
