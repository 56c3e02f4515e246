"""lbt-doctor on this machine (no GPU, no credentials) and with the environment changed by monkeypatch."""

from __future__ import annotations

from importlib import metadata
from types import SimpleNamespace

import pytest
import torch

from low_bits_training.cli import checks, config_checks, doctor
from low_bits_training.cli.checks import Check

SECRET = "doctor-secret-0123456789"


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No W&B credentials (env or netrc), no NGPU: what a fresh shell on a new machine has."""
    for k in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "NGPU", "CUDA_VISIBLE_DEVICES", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def by_name(rows: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in rows}


def test_this_machine_has_no_gpu_so_everything_is_emulated():
    c = checks.check_cuda()
    assert c.status == "WARN" and "no GPU" in c.detail and "emulated" in c.detail and c.fix
    assert checks.check_nccl() == Check("nccl", "OK", "not used without a GPU (gloo)")


def test_versions_pinned_and_old_torch_fails(monkeypatch):
    assert [c.status for c in checks.check_versions()] == ["OK", "OK", "OK"]
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda p: "2.9.0" if p == "torch" else real(p))
    torch_row = checks.check_versions()[0]
    assert torch_row.status == "FAIL" and torch_row.fix == "pip install torch==2.14.1"


def test_old_nccl_fails_new_nccl_passes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    old = checks.check_nccl()
    assert old.status == "FAIL" and "2.21.5" in old.detail and "2.23.4" in old.fix
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 23, 4))
    assert checks.check_nccl().status == "OK"


def test_gpu_count_against_ngpu(monkeypatch, clean_env):
    env = {"NGPU": "2"}
    assert checks.check_gpu_count(env).status == "OK"  # CPU: 2 gloo processes are fine
    assert checks.check_gpu_count({"NGPU": "two"}).status == "FAIL"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    too_many = checks.check_gpu_count({"NGPU": "8", "CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    assert too_many.status == "FAIL" and "CUDA_VISIBLE_DEVICES='0,1,2,3'" in too_many.detail
    assert checks.check_gpu_count({"NGPU": "2"}).status == "WARN"
    assert checks.check_gpu_count({"NGPU": "4"}).status == "OK"


def test_wandb_not_configured_is_warn_not_fail(clean_env):
    import os

    c = checks.check_wandb(os.environ)
    assert c.status == "WARN" and "not configured" in c.detail
    assert checks.check_wandb(os.environ, enabled_in_config=True).status == "FAIL"


def test_wandb_key_is_ok_and_never_shown(monkeypatch, clean_env):
    import os

    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    c = checks.check_wandb(os.environ)
    assert c.status == "OK" and c.detail == "configured (WANDB_API_KEY)" and SECRET not in repr(c)
    monkeypatch.delenv("WANDB_API_KEY")
    (clean_env / ".netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {SECRET}\n")
    assert checks.check_wandb(os.environ).detail == "configured (netrc)"


@pytest.mark.parametrize(
    "recipe, cap, emulate, status",
    [
        ("fp8_rowwise", None, None, "OK"),  # CPU: torch._scaled_mm
        ("mxfp8", None, None, "WARN"),  # CPU: emulation only
        ("nvfp4", None, None, "WARN"),
        ("fp8_tensorwise", (9, 0), None, "OK"),  # H100
        ("fp8_rowwise", (8, 0), True, "WARN"),  # A100 emulates
        ("fp8_rowwise", (8, 0), False, "FAIL"),
        ("mxfp8", (9, 0), False, "FAIL"),  # H100 has no MX kernels
        ("mxfp4", (10, 0), None, "OK"),
        ("bf16", None, None, "OK"),
        ("weird8", None, None, "WARN"),
    ],
)
def test_format_against_hardware(recipe, cap, emulate, status):
    assert config_checks.check_format(recipe, cap, emulate).status == status


def test_recipes_from_toml_and_cli():
    data = {"quantize": {"recipe": "fp8_rowwise"}}
    assert config_checks.recipes_in(data, []) == ["fp8_rowwise"]
    assert config_checks.recipes_in(data, ["--quantize.recipe", "mxfp8"]) == ["mxfp8"]
    assert config_checks.recipes_in({}, ["--quantize.recipe=nvfp4"]) == ["nvfp4"]


def test_dataset_hub_needs_network_local_must_exist(tmp_path):
    cfg = lambda name, path: SimpleNamespace(dataloader=SimpleNamespace(dataset=name, dataset_path=path))  # noqa: E731
    assert config_checks.check_dataset(cfg("c4", None), {}).status == "WARN"
    offline = config_checks.check_dataset(cfg("c4", None), {"HF_HUB_OFFLINE": "1"})
    assert offline.status == "FAIL" and "HF_HUB_OFFLINE" in offline.detail
    assert config_checks.check_dataset(cfg("local", str(tmp_path / "none")), {}).status == "FAIL"
    assert config_checks.check_dataset(cfg("local", str(tmp_path)), {}).status == "OK"


def test_disk_estimate_and_threshold(tmp_path):
    assert checks.check_disk(tmp_path / "ck", need_bytes=1).status == "OK"
    assert checks.check_disk(tmp_path / "ck", need_bytes=2**60).status == "FAIL"
    assert checks.check_disk(tmp_path, None, threshold=2**60).status == "WARN"


def test_doctor_on_debug_config(clean_env, capsys):
    rows = by_name(
        doctor.run_checks("train_configs/debug_model.toml", [], {"NGPU": "1"}, ["fp8_rowwise", "mxfp8"])
    )
    assert {k: v.status for k, v in rows.items()} == {
        "torch": "OK",
        "torchtitan": "OK",
        "torchao": "OK",
        "cuda": "WARN",
        "nccl": "OK",
        "gpu count": "OK",
        "wandb": "WARN",
        "config": "OK",
        "format fp8_rowwise": "OK",
        "format mxfp8": "WARN",
        "tokenizer": "OK",
        "dataset": "OK",
        "disk": "OK",
    }
    assert "checkpoints need ~0." in rows["disk"].detail  # 6.2M params x 12 B x 3 kept checkpoints
    assert doctor.main(["--config-file", "train_configs/debug_model.toml"]) == 0
    out = capsys.readouterr().out
    assert "| cuda " in out and "0 FAIL" in out


def test_doctor_fails_on_missing_data_and_bad_key(clean_env, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    code = doctor.main(
        [
            "--config-file",
            "train_configs/debug_model.toml",
            "--dataloader.dataset",
            "local",
            "--dataloader.dataset_path",
            str(clean_env / "missing"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 1 and "| dataset " in out and "does not exist" in out and SECRET not in out
    rows = by_name(doctor.run_checks(str(clean_env / "nope.toml"), [], {}))
    assert rows["config"].status == "FAIL" and doctor.exit_code(list(rows.values())) == 1
