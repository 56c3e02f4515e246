"""The TOML layer over torchtitan's config tree: precedence, errors, resolved config, every preset."""

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import DEBUG_TOML, REPO, write_toml
from low_bits_training.errors import ConfigError
from low_bits_training.titan.launch.configure import (
    load_config,
    resolve_base,
    save_resolved,
    wandb_configured,
)
from low_bits_training.titan.launch.worker import build_config, split_config_file

PRESETS = sorted((REPO / "train_configs").rglob("*.toml"))


def test_precedence_base_then_toml_then_cli(tmp_path):
    base = resolve_base("llama3:llama3_debugmodel")
    assert base.training.steps == 10 and base.training.seq_len == 2048  # torchtitan's own defaults
    path = write_toml(tmp_path / "x.toml", training={"steps": 33, "seq_len": 64})
    cfg = load_config(path, [])
    assert (cfg.training.steps, cfg.training.seq_len) == (33, 64)
    cfg = load_config(path, ["--training.steps", "4"])
    assert (cfg.training.steps, cfg.training.seq_len) == (4, 64)  # CLI wins, the rest of the TOML stays


def test_job_name_sets_the_run_folder_unless_given(tmp_path):
    cfg = load_config(write_toml(tmp_path / "a.toml", job={"name": "abc"}), [])
    assert cfg.dump_folder == "outputs/abc"
    cfg = load_config(write_toml(tmp_path / "b.toml", job={"name": "abc"}, dump_folder="elsewhere"), [])
    assert cfg.dump_folder == "elsewhere"


def test_cli_base_overrides_toml_base(tmp_path):
    cfg = load_config(DEBUG_TOML, ["--job.base", "llama3:llama3_debugmodel_ce_loss"])
    assert cfg.job.base == "llama3:llama3_debugmodel_ce_loss"
    assert type(cfg.loss).__name__ == "Config" and "CrossEntropy" in type(cfg.loss).__qualname__


@pytest.mark.parametrize(
    "base, message",
    [
        ("llama3", "job.base = 'llama3': expected 'module:function'"),
        ("nosuchmodel:x", "job.base = 'nosuchmodel:x': Cannot import module 'nosuchmodel'"),
        ("llama3:nope", "job.base = 'llama3:nope': Config function 'nope' not found"),
        ("json:dumps", "job.base = 'json:dumps'"),
    ],
)
def test_bad_base_is_one_line(base, message):
    with pytest.raises(ConfigError) as e:
        resolve_base(base)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--quantize.backend", "real"],
            "quantize.backend = 'real': expected one of emulate, torchao, auto (the hand-written _scaled_mm",
        ),
        (["--numerics.nonfinite=halt"], "numerics.nonfinite = 'halt': expected one of off, warn, skip, stop"),
        (["--numerics.stats-freq", "-1"], "numerics.stats_freq = -1: expected an int >= 0 (0: off)"),
    ],
)
def test_a_flag_is_refused_in_the_words_of_the_toml(flags, message):
    # A choice tyro refuses and a bound the section refuses read as the same key in a TOML file would.
    with pytest.raises(ConfigError) as e:
        load_config(DEBUG_TOML, flags)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match=r"^CONFIG_FILE = '.*nope.toml': no such file$"):
        load_config(tmp_path / "nope.toml", [])
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps = 1\n")
    with pytest.raises(ConfigError, match=r"not valid TOML"):
        load_config(bad, [])


def test_torchtitan_cross_field_checks_run_after_the_toml(tmp_path):
    path = write_toml(
        tmp_path / "pp.toml",
        parallelism={"pipeline_parallel_degree": 2, "pipeline_parallel_microbatch_size": 3},
    )
    with pytest.raises(ConfigError, match=r"local_batch_size \(8\) must be evenly divisible"):
        build_config(["--config-file", str(path)])


def test_local_dataset_without_files_is_refused(tmp_path):
    path = write_toml(
        tmp_path / "l.toml", dataloader={"dataset": "local", "dataset_path": str(tmp_path / "none")}
    )
    with pytest.raises(
        ConfigError, match=r"^dataloader.dataset_path = .*: no .txt/.json/.jsonl/.parquet files found$"
    ):
        build_config(["--config-file", str(path)])


def test_split_config_file(monkeypatch):
    monkeypatch.setenv("CONFIG_FILE", "env.toml")
    assert split_config_file(["--a", "1"]) == ("env.toml", ["--a", "1"])
    assert split_config_file(["--config-file=x.toml", "--a", "1"]) == ("x.toml", ["--a", "1"])
    assert split_config_file(["--config-file", "y.toml"]) == ("y.toml", [])


def test_resolved_config_reruns_to_the_same_tree(tmp_path):
    cfg = build_config(
        ["--config-file", str(DEBUG_TOML), "--training.steps", "7", "--optimizer.implementation", "for-loop"]
    )
    path = save_resolved(cfg, tmp_path, ["train", "--training.steps", "7"])
    again = build_config(["--config-file", str(path)])
    a, b = again.to_dict(), cfg.to_dict()
    assert (
        a.pop("model_spec")["flavor"] == b.pop("model_spec")["flavor"]
    )  # the rest holds reprs with addresses
    assert a == b
    assert (tmp_path / "config.json").is_file() and "--training.steps 7" in (
        tmp_path / "command.txt"
    ).read_text()


def test_secrets_never_reach_saved_files_logs_or_wandb(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "sekrit-123")
    cfg = build_config(["--config-file", str(DEBUG_TOML)])
    assert cfg.metrics.enable_wandb  # the user set W&B up, so it is used
    cfg.optimizer.param_groups[0].optimizer_kwargs["hf_token"] = "hf_sekrit"
    save_resolved(
        cfg, tmp_path, ["x", "--hf.token", "hf_sekrit2", "--wandb.api_key=sekrit3", "--training.steps", "4"]
    )
    for f in tmp_path.iterdir():
        assert "sekrit" not in f.read_text(), f.name
    assert "--training.steps 4" in (tmp_path / "command.txt").read_text()
    # to_dict is what torchtitan prints (debug.print_config), saves and hands to W&B as the run config
    kwargs = cfg.to_dict()["optimizer"]["param_groups"][0]["optimizer_kwargs"]
    assert kwargs["hf_token"] == "<redacted>" and kwargs["lr"] == 3e-3


def test_wandb_stays_out_of_the_way_without_credentials(tmp_path):
    assert not wandb_configured({"NETRC": str(tmp_path / "none")})
    assert wandb_configured({"WANDB_MODE": "offline"})
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password x\n")
    assert wandb_configured({"NETRC": str(tmp_path / "netrc")})


@pytest.mark.parametrize("preset", PRESETS, ids=[str(p.relative_to(REPO)) for p in PRESETS])
def test_every_preset_loads_and_validates(preset):
    cfg = load_config(preset, [])
    cfg.__post_init__()
    assert cfg.model_spec is not None and cfg.training.steps > 0


def test_launcher_refuses_bad_input_with_one_line_and_exit_2(tmp_path):
    path = write_toml(tmp_path / "bad.toml", training={"stepz": 4})
    p = subprocess.run(
        [sys.executable, "-m", "low_bits_training.titan.launch.worker", "--config-file", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert p.returncode == 2
    err = [ln for ln in p.stderr.splitlines() if ln.startswith("low-bits-training")]
    assert err == [
        "low-bits-training: config error: unknown key 'training.stepz' in [training]; allowed keys: "
        "disable_cuda_graphs, dtype, enable_cpu_offload, gc_debug, gc_freq, global_batch_size, "
        "local_batch_size, max_norm, mixed_precision_param, mixed_precision_reduce, seq_len, steps"
    ]
    assert "Traceback" not in p.stderr
    assert not (Path(REPO) / "outputs" / "debug_model" / "bad").exists()


def test_unknown_dataset_name_is_refused_before_any_rank(tmp_path):
    path = write_toml(tmp_path / "d.toml", dataloader={"dataset": "c5"})
    with pytest.raises(ConfigError, match=r"^dataloader.dataset = 'c5': expected one of c4, .*lbt_markov"):
        build_config(["--config-file", str(path)])


def test_resolved_files_replace_the_previous_ones_whole(tmp_path):
    # Written through a temporary name and a rename: no half file, no leftover temporary.
    cfg = build_config(["--config-file", str(DEBUG_TOML), "--training.steps", "7"])
    save_resolved(cfg, tmp_path, ["a"])
    save_resolved(cfg, tmp_path, ["b"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["command.txt", "config.json", "config.toml"]
    assert (tmp_path / "command.txt").read_text() == "b\n"
