"""The precision plan in real torchtitan training on CPU ranks: TP, PP, FSDP2 + checkpoints across recipes."""

import subprocess
import sys

import pytest

from helpers import CORPUS, REPO, train, write_toml


def _config(tmp_path, recipe, **extra):
    return write_toml(tmp_path / f"{recipe}.toml", quantize={"recipe": recipe, **extra})


def test_bad_plan_is_a_config_error_before_the_model(tmp_path):
    cfg = _config(tmp_path, "mxfp8", rules=[{"layers": ["layers.*.attn.*"], "format": "e4m3"}])
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "low_bits_training.titan.launch.worker",
            "--config-file",
            str(cfg),
            "--dump_folder",
            str(tmp_path / "run"),
            "--dataloader.dataset_path",
            str(CORPUS),
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


def test_fsdp_checkpoint_bf16_to_fp8_and_back(tmp_path):
    # Switching recipe is starting a new run from a checkpoint on purpose (initial_load_path): the run-shape
    # fingerprint of titan/runtime/manifest.py refuses a plain resume into a different plan.
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
    from low_bits_training.config.quantize import QuantizeConfig
    from low_bits_training.titan.launch.configure import load_config
    from low_bits_training.titan.targets.registry import apply_run

    config = load_config(path, [])
    assert config.quantize != QuantizeConfig() or path.stem == "debug_bf16"
    plans = apply_run(config).plans
    assert plans["lm_head"].is_high_precision
    quantized = [f for f, p in plans.items() if not p.is_high_precision]
    assert (len(quantized) == 0) == (config.quantize.recipe == "bf16")


@pytest.mark.parametrize(
    "path", sorted((REPO / "train_configs").glob("recipes/debug_*.toml")), ids=lambda p: p.stem
)
def test_debug_presets_are_the_debug_model_plus_their_quantize(path):
    """Each recipe preset says it is debug_model.toml plus [quantize]: the same seed, data, optimizer and
    shape, so its losses compare with the debug model's (a preset without the seed initialised the model
    differently in every run)."""
    import tomllib

    def rest(p):
        toml = tomllib.loads(p.read_text())
        toml.pop("quantize", None)
        toml["job"] = {k: v for k, v in toml["job"].items() if k not in ("name", "description")}
        if p.stem == "debug_fsdp_lowbit_comm":  # low-bit FSDP all-gathers need two data ranks
            assert toml.pop("parallelism") == {"data_parallel_shard_degree": 2}
        return toml

    base = rest(REPO / "train_configs" / "debug_model.toml")
    assert base["debug"]["seed"] == 0
    assert rest(path) == base


@pytest.mark.parametrize("path", sorted((REPO / "train_configs").rglob("debug_*.toml")), ids=lambda p: p.stem)
def test_every_debug_config_is_seeded(path):
    """Same config, same losses (docs/reliability.md): every debug config fixes torchtitan's seed."""
    import tomllib

    assert tomllib.loads(path.read_text()).get("debug", {}).get("seed") == 0


def _plan_table(run) -> str:
    return (run.folder / "precision_plan.txt").read_text()


def _row_modules(table: str) -> set[str]:
    return {
        m
        for m in ("QuantLinear", "torchao Float8Linear", "torchao MXFP8Linear", "torchtitan Float8Linear")
        if m in table
    }


MIXED_RULES = [
    {"layers": ["layers.0.*"], "roles": ["dgrad.grad_output"], "rounding": "stochastic"},  # ours: SR
    {"layers": ["layers.1.*"], "format": "e4m3", "scaling": "block", "block_size": 32, "scale_format": "e8m0", "scale_rounding": "rceil"},  # mxfp8
]  # fmt: skip


def test_mixed_torchao_and_emulated_layers_train(tmp_path):
    cfg = _config(tmp_path, "fp8_rowwise", backend="torchao", rules=MIXED_RULES)
    run = train(tmp_path, "--training.steps", "4", "--checkpoint.no-enable", config=cfg)
    assert sorted(run.losses) == [1, 2, 3, 4] and run.losses[4] < run.losses[1] - 0.2, run.losses
    table = _plan_table(run)
    assert _row_modules(table) == {"QuantLinear", "torchao Float8Linear", "torchao MXFP8Linear"}, table
    assert "torchao_emulated" in table and " emulate" in table


def test_fsdp2_fp8_all_gather_through_torchao(tmp_path):
    options = {"enable_fsdp_float8_all_gather": True, "precompute_float8_dynamic_scale_for_fsdp": True}
    cfg = _config(tmp_path, "fp8_tensorwise", backend="torchao", torchao=options, rules=MIXED_RULES[:1])
    fsdp = ("--parallelism.data_parallel_shard_degree", "2", "--checkpoint.no-enable")
    run = train(tmp_path, "--training.steps", "3", *fsdp, nproc=2, config=cfg)
    assert sorted(run.losses) == [1, 2, 3] and run.losses[3] < run.losses[1] - 0.1, run.losses
    # 5 linears x 5 blocks go to torchao (block 0 is ours: stochastic rounding); their weights travel in fp8.
    assert "torchao: FSDP2 all-gathers 25 weights in fp8" in run.log


def test_base_with_torchtitan_converters_works_with_quantize(tmp_path):
    # Was refused: "quantize.skip: 'lm_head' matches no linear layer; layers are " (issue 11).
    base = ("--job.base", "tests.titan.converted_base:debugmodel_float8_attention_only")
    run = train(
        tmp_path, *base, "--training.steps", "3", "--checkpoint.no-enable", config=_config(tmp_path, "mxfp8")
    )
    assert run.losses[3] < run.losses[1], run.losses
    table = _plan_table(run)
    assert _row_modules(table) == {"torchtitan Float8Linear", "QuantLinear"}, table
    row = next(line for line in table.splitlines() if "attention.qkv_linear.wqkv" in line)
    assert "torchtitan Float8Linear (tensorwise, emulate)" in row and row.split()[-1] == "torchtitan"


@pytest.mark.parametrize(
    ("preset", "gpu", "want"),
    [
        ("llama3_8b_fp8_rowwise", (9, 0), "torchao"),
        ("llama3_8b_fp8_rowwise", (8, 0), "emulate"),
        ("llama3_8b_mxfp8", (10, 0), "torchao"),
        ("llama3_8b_mxfp8", (9, 0), "emulate"),
    ],
)
def test_8b_presets_compile_and_take_torchao_kernels_on_their_gpus(preset, gpu, want):
    from low_bits_training.nn.hardware import Hardware
    from low_bits_training.plan.backends import gemm_backend
    from low_bits_training.titan.launch.configure import load_config
    from low_bits_training.titan.targets.attention import attention_layers
    from low_bits_training.titan.targets.registry import plan_on

    config = load_config(REPO / "train_configs" / f"{preset}.toml", [])
    assert config.compile.enable and "model" in config.compile.components
    assert config.quantize.backend == "auto"
    plans = plan_on(config, Hardware("cuda", gpu))
    attention = attention_layers(config.model_spec.model, config.training.seq_len)  # high: no rule names them
    assert all(plans[f].is_high_precision for f in attention)
    backends = {gemm_backend(p, "forward") for f, p in plans.items() if f != "lm_head" and f not in attention}
    assert backends == {want} and gemm_backend(plans["lm_head"], "forward") == "high"
