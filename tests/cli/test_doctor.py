"""lbt-doctor on this machine (no GPU, no credentials) and with the environment changed by monkeypatch."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import write_toml
from low_bits_training.cli import checks, config_checks, doctor, resource_checks
from low_bits_training.cli.checks import Check
from low_bits_training.cli.speed import spec_for
from low_bits_training.config import job
from low_bits_training.run.exits import ExitCode
from low_bits_training.speed.gpus import GPUS
from low_bits_training.titan.platform.devices import gpu_count_refusal

SECRET = "doctor-secret-0123456789"
REPO = Path(__file__).resolve().parents[2]
DEBUG = REPO / "train_configs" / "debug_model.toml"


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No W&B credentials (env or netrc), no NGPU: what a fresh shell on a new machine has."""
    for k in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "NGPU", "CUDA_VISIBLE_DEVICES", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    # run folders under tmp_path, not the checkout's outputs/ (where ./run_llama_train.sh, the README's first
    # command, leaves a bf16 debug_model checkpoint that every check of another plan would refuse to resume)
    monkeypatch.setattr(job, "RUNS_FOLDER", str(tmp_path / "outputs"))
    return tmp_path


def by_name(rows: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in rows}


def test_this_machine_has_no_gpu_so_everything_is_emulated():
    c = checks.check_cuda()
    assert c.status == "WARN" and "no GPU" in c.detail and "emulated" in c.detail and c.fix


def test_a_driver_torch_cannot_use_fails_the_cuda_row_with_the_launchers_line(monkeypatch):
    from low_bits_training.titan.platform import devices

    monkeypatch.delenv(devices.ALLOW_CPU_RANKS, raising=False)
    monkeypatch.setattr(devices, "nvidia_driver", lambda: "NVRM version: 535.104.05")  # older than CUDA 13's
    c = checks.check_cuda()
    assert (c.status, c.detail) == ("FAIL", devices.this_machine_refusal())
    assert c.detail.startswith(
        "this machine has an NVIDIA driver (NVRM version: 535.104.05) but torch sees no GPU"
    )
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
    assert too_many.detail == gpu_count_refusal(8, 4, "0,1,2,3")  # the launcher's refusal, one home
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
    assert checks.check_wandb(os.environ).status == "WARN"
    (clean_env / ".netrc").write_text(f"machine api.wandb.ai\n  login user\n  password {SECRET}\n")
    c = checks.check_wandb(os.environ)  # the launcher's own test (run.secrets.wandb_credentials)
    assert c.status == "OK" and c.detail == "configured (netrc)" and SECRET not in repr(c)


def test_dataset_hub_needs_network_local_must_exist(tmp_path):
    cfg = lambda name, path: SimpleNamespace(dataloader=SimpleNamespace(dataset=name, dataset_path=path))  # noqa: E731
    assert resource_checks.check_dataset(cfg("c4", None), {}).status == "WARN"
    offline = resource_checks.check_dataset(cfg("c4", None), {"HF_HUB_OFFLINE": "1"})
    assert offline.status == "FAIL" and "HF_HUB_OFFLINE" in offline.detail
    assert resource_checks.check_dataset(cfg("local", str(tmp_path / "none")), {}).status == "FAIL"
    assert resource_checks.check_dataset(cfg("local", str(tmp_path)), {}).status == "OK"


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
        "backends": "OK",  # the debug model is bf16: every linear high precision
        "compile": "OK",
        "CUDA graphs": "OK",  # off on a CPU (no "speed" row there)
        "recipe fp8_rowwise": "WARN",  # CPU: emulated
        "recipe mxfp8": "WARN",
        "tokenizer": "OK",
        "state bytes": "OK",
        "peak memory": "OK",
        "dataset": "OK",
        "disk": "OK",
    }
    assert rows["backends"].detail == "on CPU: 31 x Linear [high]"
    # the launcher's plan (titan/runtime/peak.py), as the default run logs it (docs/memory.md)
    assert rows["peak memory"].detail.startswith(
        "0.25 GiB on rank 0 (first step 0.20, later steps 0.25; at the peak, in the forward and backward: "
    )
    assert rows["state bytes"].detail.startswith("16.00 B/param x 6.16 M params = 0.09 GiB on all ranks: ")
    assert "exp_avg 4.00 (fp32), exp_avg_sq 4.00 (fp32)" in rows["state bytes"].detail
    assert rows["recipe mxfp8"].detail == "on CPU: 1 x Linear [high]; 30 x QuantLinear [emulate]"
    assert (
        "checkpoints need ~0.21 GiB" in rows["disk"].detail
    )  # 6.16M params x 12 B (params + moments) x 3 kept
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
    # The launcher's own validation refuses it (one line, as run_llama_train.sh would print it); a FAIL exits
    # with the launcher's code for a refused job (run/exits.py), not 1 (a crash).
    assert code == ExitCode.CONFIG == 2 and "| config " in out and "dataloader.dataset_path = " in out
    assert SECRET not in out
    rows = by_name(doctor.run_checks(str(clean_env / "nope.toml"), [], {}))
    assert rows["config"].status == "FAIL" and doctor.exit_code(list(rows.values())) == ExitCode.CONFIG
    assert doctor.exit_code([Check("a", "OK", ""), Check("b", "WARN", "")]) == ExitCode.OK


def test_the_console_script_exits_2_on_a_fail(clean_env):
    # What a shell sees (`lbt-doctor ... || exit`): the process's status, through the [project.scripts] entry.
    import subprocess
    import sys

    script = "import sys; from low_bits_training.cli.doctor import main; sys.exit(main())"
    p = subprocess.run(
        [sys.executable, "-c", script, "--config-file", str(clean_env / "nope.toml")],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert p.returncode == 2 and "| config " in p.stdout and "\n1 FAIL, " in p.stdout, p.stderr[-2000:]


def test_no_arguments_check_the_run_the_launcher_starts_by_default(clean_env, monkeypatch, capsys):
    # run_llama_train.sh: CONFIG_FILE="${CONFIG_FILE:-train_configs/debug_model.toml}"; the doctor's default is it.
    script = (REPO / "run_llama_train.sh").read_text()
    assert f'CONFIG_FILE="${{CONFIG_FILE:-{doctor.DEFAULT_CONFIG_FILE}}}"' in script
    monkeypatch.delenv("CONFIG_FILE", raising=False)
    monkeypatch.chdir(clean_env)  # elsewhere than the repository: found next to the package
    rows = by_name(doctor.run_checks(None, [], {}))
    assert (
        rows["config"].status == "OK"
        and "debug_model.toml -> llama3:llama3_debugmodel" in rows["config"].detail
    )
    assert rows["tokenizer"].detail.endswith("tokenizer.json")
    assert doctor.main([]) == 0 and "0 FAIL" in capsys.readouterr().out


def test_a_missing_tokenizer_is_a_warn_the_plan_still_shows_and_the_launcher_refuses(clean_env, capsys):
    # issue 30: the 8B presets name a Llama tokenizer a fresh clone lacks; doctor says so and still shows the
    # backend and recipe rows (the rest resolved with the built-in corpus); the launcher refuses with exit 2.
    from low_bits_training.titan.launch import launcher

    empty = clean_env / "no_tokenizer"
    empty.mkdir()
    args = ["--hf_assets_path", str(empty), "--quantize.recipe", "mxfp8"]
    rows = by_name(doctor.run_checks(str(DEBUG), args, {}, ["fp8_rowwise"], doctor.hardware("sm100")))
    refusal = f"hf_assets_path = '{empty}': none of tokenizer.json, vocab.json, vocab.txt there"
    config = rows["config"]
    assert config.status == "WARN" and config.detail.startswith(refusal)
    assert "training stops here (the launcher exits 2)" in config.detail
    assert "--hf_assets_path DIR" in config.fix and "--dataloader.dataset lbt_markov" in config.fix
    assert rows["backends"].detail == (
        "on CUDA SM100: 1 x Linear [high]; 30 x torchao MXFP8Linear (mxfp8 rceil) [torchao]"
    )
    assert rows["recipe fp8_rowwise"].detail == (
        "on CUDA SM100: 1 x Linear [high]; 30 x torchao Float8Linear (rowwise) [torchao]"
    )
    assert "tokenizer" not in rows and "dataset" not in rows  # the stand-in's would say nothing of the run's
    assert doctor.exit_code(list(rows.values())) == ExitCode.OK
    code = launcher.main(["--check-only", "--", "--config-file", str(DEBUG), *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        code == ExitCode.CONFIG
        and len(err) == 1
        and err[0].startswith(f"low-bits-training: config error: {refusal}")
    )
    # without the stand-in (what every other caller asks) the same refusal is a FAIL
    status, built = config_checks.checked_config(str(DEBUG), args)
    assert (status.status, built) == ("FAIL", None) and status.detail.startswith(refusal)


@pytest.mark.parametrize(
    ("hardware", "args", "status", "detail"),
    [
        ("cpu", [], "WARN", "on CPU: 1 x Linear [high]; 30 x QuantLinear [emulate]"),
        ("sm90", [], "WARN", "on CUDA SM90: 1 x Linear [high]; 30 x QuantLinear [emulate]"),
        (
            "sm100",
            [],
            "OK",
            "on CUDA SM100: 1 x Linear [high]; 30 x torchao MXFP8Linear (mxfp8 rceil) [torchao]",
        ),
        (
            "sm90",
            ["--quantize.backend", "torchao"],
            "WARN",
            "on CUDA SM90: 1 x Linear [high]; 30 x torchao MXFP8Linear (mxfp8 rceil) [torchao_emulated]",
        ),
    ],
)
def test_backends_judged_on_named_hardware(clean_env, hardware, args, status, detail):
    args = ["--quantize.recipe", "mxfp8", *args]
    rows = by_name(doctor.run_checks(str(DEBUG), args, {}, hw=doctor.hardware(hardware)))
    assert (rows["backends"].status, rows["backends"].detail) == (status, detail)
    if hardware == "sm90" and status == "WARN" and not args[2:]:
        assert "MXFP8Linear kernels need CUDA SM100+" in rows["backends"].fix


def test_compile_against_the_backends(clean_env):
    mx = ["--quantize.recipe", "mxfp8", "--quantize.backend", "torchao"]
    rows = by_name(doctor.run_checks(str(DEBUG), [*mx, "--compile.enable"], {}, hw=doctor.hardware("sm90")))
    assert rows["compile"].status == "WARN" and "refused by torchtitan" in rows["compile"].detail
    rows = by_name(doctor.run_checks(str(DEBUG), mx, {}, hw=doctor.hardware("sm100")))
    assert rows["compile"].status == "WARN" and "enable [compile]" in rows["compile"].fix
    rows = by_name(doctor.run_checks(str(DEBUG), [*mx, "--compile.enable"], {}, hw=doctor.hardware("cpu")))
    assert rows["compile"].status == "OK"  # torchao's emulated mode compiles on CPU (tests/titan)


def _built_modules(config) -> dict[str, str]:
    from torchtitan.models.common.attention import FlexAttention

    with torch.device("meta"):
        model = config.model_spec.model.build()
    out = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    # the attention products, <attention fqn>.qk / .pv (titan/targets/attention.py): FlexAttention, the CPU
    # adapter's
    # DenseMaskAttention or QuantFlexAttention
    for n, m in model.named_modules():
        if isinstance(m, FlexAttention):
            kind = "QuantFlexAttention" if type(m).__name__ == "QuantFlexAttention" else "FlexAttention"
            out.update({f"{n.removesuffix('.inner_attention')}.{p}": kind for p in ("qk", "pv")})
    return out


MODULE_CLASS = {  # plan-table label (first word(s)) -> the class the trainer builds
    "Linear": "Linear",
    "QuantLinear": "TitanQuantLinear",
    "torchao Float8Linear": "TorchaoFloat8Linear",
    "torchao MXFP8Linear": "TorchaoMXFP8Linear",
    "torchtitan Float8Linear": "Float8Linear",
    "FlexAttention": "FlexAttention",
    "QuantAttention": "QuantFlexAttention",
}


MIXED = [{"layers": ["layers.1.*"], "roles": ["dgrad.grad_output"], "rounding": "stochastic"}]
ATTENTION = [{"layers": ["layers.[12].attention.qk"], "format": "e4m3", "scaling": "tensor"}]


@pytest.mark.parametrize(
    ("quantize", "base"),
    [
        ({"recipe": "fp8_rowwise", "backend": "torchao", "rules": MIXED}, None),
        (
            {
                "recipe": "mxfp8",
                "backend": "torchao",
                "rules": [{"layers": ["layers.2.*"], "format": "high"}, *MIXED],
            },
            None,
        ),
        ({"recipe": "mxfp8"}, "tests.titan.converted_base:debugmodel_float8_attention_only"),
        ({"recipe": "fp8_rowwise", "backend": "torchao", "rules": [*MIXED, *ATTENTION]}, None),
    ],
    ids=["torchao-fp8-mixed", "torchao-mxfp8-mixed", "torchtitan-converted-base", "with-attention"],
)
def test_doctor_and_plan_table_agree_with_the_built_model(clean_env, monkeypatch, quantize, base):
    from low_bits_training.cli.config_checks import checked_config
    from low_bits_training.cli.plan_checks import layer_backends
    from low_bits_training.nn import GEMMS
    from low_bits_training.nn.hardware import detect_hardware
    from low_bits_training.plan.backends import gemm_backend
    from low_bits_training.titan.targets.registry import current_plans

    monkeypatch.syspath_prepend(str(REPO))  # the converted base lives in tests/
    toml = write_toml(clean_env / "run.toml", quantize=quantize)
    status, config = checked_config(str(toml), ["--job.base", base] if base else [])
    assert status.status == "OK", status.detail
    doctor_view = layer_backends(config, detect_hardware())
    plans, modules = current_plans(config)  # what precision_plan.txt prints
    table_view = {f: (modules[f], tuple(gemm_backend(p, g) for g in GEMMS)) for f, p in plans.items()}
    assert doctor_view == table_view
    built = _built_modules(config)
    assert set(built) == set(table_view)
    for fqn, (label, _) in table_view.items():
        cls = next(
            c for prefix, c in MODULE_CLASS.items() if label == prefix or label.startswith(prefix + " (")
        )
        assert built[fqn] == cls, (fqn, label, built[fqn])
    kinds = {label.split(" (")[0] for label, _ in table_view.values()}
    assert len(kinds) >= 3, kinds  # mixed models: high, ours or torchtitan's, torchao's


def test_doctor_runs_the_launchers_whole_check(clean_env):
    # A parallel layout the launcher refuses for NGPU processes (validate.check_run) is a FAIL here too,
    # with the launcher's own line.
    from low_bits_training.cli.config_checks import checked_config
    from low_bits_training.titan.launch.launcher import check

    args = ["--parallelism.tensor_parallel_degree", "2", "--dump_folder", str(clean_env / "out")]
    status, config = checked_config("train_configs/debug_model.toml", args, {"NGPU": "1"})
    assert status.status == "FAIL" and config is None
    with pytest.raises(Exception) as launcher:
        check(["--config-file", "train_configs/debug_model.toml", *args], 1)
    assert status.detail == str(launcher.value)
    status, _ = checked_config("train_configs/debug_model.toml", args, {"NGPU": "2"})
    assert status.status == "OK" and "2 process(es), a fresh start" in status.detail


def test_every_layer_that_falls_back_says_why_in_doctor_and_the_plan_table(clean_env, monkeypatch):
    # issue 29: plan.backends.fallback_reason, one row (one line under the plan table) per group of layers.
    from low_bits_training.titan.targets.registry import save_plan

    monkeypatch.chdir(REPO)
    mixed = "train_configs/recipes/debug_torchao_mixed.toml"  # layer 0 stochastic, layer 1 MXFP8, rest fp8
    names = lambda i: ", ".join(  # noqa: E731
        f"layers.[{i}].{n}"
        for n in ("attention.qkv_linear.wqkv", "attention.wo", *(f"feed_forward.w{j}" for j in (1, 2, 3)))
    )
    sr = "emulated: torchao has no training module for stochastic rounding"
    checks = doctor.run_checks(
        mixed, ["--dump_folder", str(clean_env / "out")], {}, hw=doctor.hardware("sm90")
    )
    assert [(c.status, c.detail) for c in checks if c.name == "fallback"] == [
        ("WARN", f"{names(0)}: {sr}"),
        ("WARN", f"{names(1)}: torchao emulated: MXFP8Linear kernels need CUDA SM100+, this is CUDA SM90"),
    ]
    _, config = config_checks.checked_config(mixed, ["--dump_folder", str(clean_env / "out")])
    text = save_plan(config, clean_env / "run").read_text()  # this machine: a CPU
    assert text.endswith(
        "not on torchao's kernel (on CPU, backend = 'torchao'):\n"
        f"  {names(0)}: {sr}\n"
        f"  {names(1)}: torchao emulated: MXFP8Linear kernels need CUDA SM100+, this is CPU\n"
        f"  {names('2-5')}: torchao emulated: Float8Linear kernels need CUDA SM89+, this is CPU\n"
    )


LOWBIT = "train_configs/optim/lowbit_adamw_int8.toml"
DEFAULT = "train_configs/debug_model.toml"


@pytest.mark.parametrize(
    ("config", "args", "head", "moments", "checkpoints"),
    [
        # LowBitAdamW's int8 / e4m3 block-128 moments: 1 + 4/128 bytes each (norm weights keep fp32 ones); a
        # checkpoint holds params + moments: 6.07 B/param x 6.16 M x 3 kept = 0.10 GiB (fp32 AdamW: 0.21)
        (
            LOWBIT,
            [],
            "10.07 B/param x 6.16 M params",
            "exp_avg 1.03 (int8 codes + fp32 scale/128; fp32)",
            0.10,
        ),
        (
            LOWBIT,
            ["--training.dtype", "bfloat16"],
            "6.07 B/param",
            "params 2.00 (bf16), grads 2.00 (bf16)",
            0.07,
        ),
        (
            DEFAULT,
            ["--training.dtype", "bfloat16"],
            "8.00 B/param",
            "exp_avg 2.00 (bf16), exp_avg_sq 2.00",
            0.10,
        ),
        (
            DEFAULT,
            ["--optimizer.implementation", "fused_opt_states_bf16"],
            "12.00 B/param",
            "grads 4.00 (fp32), exp_avg 2.00 (bf16), exp_avg_sq 2.00 (bf16)",
            0.14,
        ),
    ],
    ids=["lowbit", "lowbit-bf16-params", "default-bf16-params", "default-bf16-moments"],
)
def test_state_bytes_row_and_checkpoint_estimate_follow_the_optimizer(
    clean_env, config, args, head, moments, checkpoints
):
    rows = by_name(doctor.run_checks(config, args, {"NGPU": "1"}))
    detail = rows["state bytes"].detail
    assert rows["state bytes"].status == "OK" and detail.startswith(head) and moments in detail
    assert f"checkpoints need ~{checkpoints:.2f} GiB" in rows["disk"].detail


def test_saved_row_shows_the_lean_presets_save_format_and_its_state_bytes(clean_env):
    rows = by_name(doctor.run_checks(str(REPO / "train_configs" / "debug_lean.toml"), [], {"NGPU": "1"}))
    assert rows["saved"].status == "OK"
    assert rows["saved"].detail.startswith("e4m3/axis-1(fp32,exact)/rne: 6 modules (layers.0 ...)")
    assert rows["state bytes"].detail.startswith("5.07 B/param")
    assert "saved" not in by_name(doctor.run_checks(str(DEBUG), [], {"NGPU": "1"}))  # no rules, no row


def test_autopilot_row_names_its_ladder_triggers_and_the_layers_it_watches(clean_env):
    on = ["--quantize.autopilot.enable", "--quantize.autopilot.ladder", "nvfp4,mxfp8,high"]
    rows = by_name(doctor.run_checks(str(DEBUG), [*on, "--quantize.recipe", "nvfp4"], {"NGPU": "1"}))
    assert rows["autopilot"].status == "OK"
    assert rows["autopilot"].detail == (
        "ladder nvfp4 -> mxfp8 -> high; triggers: nonfinite, saturation > 0.01, underflow > 0.5, "
        "loss / grad-norm spike > 6 sd (host snapshots every 10 steps, then promote); "
        "watches 30 quantized targets (30 linear)"
    )  # the debug model: 6 blocks x 5 linears (wqkv, wo, w1, w2, w3); lm_head skipped
    bf16 = by_name(doctor.run_checks(str(DEBUG), on, {"NGPU": "1"}))
    assert bf16["autopilot"].status == "WARN" and "no quantized target of ours" in bf16["autopilot"].detail
    assert "autopilot" not in by_name(doctor.run_checks(str(DEBUG), [], {"NGPU": "1"}))  # off: no row
    moe = by_name(doctor.run_checks(str(DEBUG.parent / "debug_moe.toml"), on, {"NGPU": "1"}))
    assert moe["autopilot"].detail.endswith("watches 12 quantized targets (12 experts)")  # 4 layers x w1-w3


@pytest.mark.parametrize(
    "hardware, args, detail",
    [
        ("sm90", ["--quantize.autopilot.enable"],
         "off: [quantize.autopilot] switches plans and redoes steps mid-run"),
        ("sm100", ["--quantize.recipe", "nvfp4"],
         "on: torchtitan captures each microbatch's forward + backward once and replays it"),
        ("sm90", ["--quantize.recipe", "nvfp4", "--training.disable_cuda_graphs"],
         "off: training.disable_cuda_graphs = true"),
        ("cpu", [], "off: no GPU (a CPU run; --hardware sm90 judges a GPU's)"),
    ],
)  # fmt: skip
def test_cuda_graph_row_says_what_the_run_gets_on_that_gpu(clean_env, hardware, args, detail):
    rows = by_name(doctor.run_checks(str(DEBUG), args, {"NGPU": "1"}, hw=doctor.hardware(hardware)))
    assert (rows["CUDA graphs"].status, rows["CUDA graphs"].detail) == ("OK", detail)


def test_speed_row_says_what_this_package_runs_on_that_gpu(clean_env):
    deepseek = ["--quantize.recipe", "deepseek_fp8"]
    row = by_name(doctor.run_checks(str(DEBUG), deepseek, {"NGPU": "1"}, hw=doctor.hardware("sm90")))["speed"]
    assert (row.status, row.detail) == (
        "WARN",
        "this package on H100: 100% of the quantized GEMM FLOPs emulated, 84% of the GEMM FLOPs in fp32 on "
        "CUDA cores: predicted step 0.31x bf16's (the kernels' figure: 0.62x)",
    )  # the debug model's GEMMs are small: kernel overheads weigh; on Llama 3 8B 0.12x vs 1.22x (docs)
    bf16 = by_name(doctor.run_checks(str(DEBUG), [], {"NGPU": "1"}, hw=doctor.hardware("sm100")))["speed"]
    assert (bf16.status, bf16.detail) == (
        "OK",
        "this package on B200: no quantized GEMM emulated; step 1.00x bf16's",
    )
    assert "speed" not in by_name(
        doctor.run_checks(str(DEBUG), deepseek, {"NGPU": "1"}, hw=doctor.hardware("cpu"))
    )


def test_a_named_gpu_is_judged_on_its_architecture_and_priced_as_that_gpu(clean_env):
    # --hardware h200: the plan resolved as on any SM90 (the same backends row as --hardware sm90), the speed row
    # priced on that GPU's figures (an architecture alone: on the part that stands for it)
    deepseek = ["--quantize.recipe", "deepseek_fp8"]
    rows = {
        name: by_name(doctor.run_checks(str(DEBUG), deepseek, {"NGPU": "1"}, hw=doctor.hardware(name)))
        for name in ("sm90", "h100", "h200")
    }
    assert rows["h200"]["backends"].detail == rows["sm90"]["backends"].detail
    assert rows["h100"]["speed"].detail == rows["sm90"]["speed"].detail
    assert rows["h200"]["speed"].detail.startswith("this package on H200: ")
    assert [spec_for(doctor.hardware(n)) for n in ("h200-nvl", "sm90", "b300")] == [
        GPUS["H200-NVL"],
        GPUS["H100"],
        GPUS["B300"],
    ]


def test_fit_ranks_the_changes_that_fit_first(clean_env, capsys):
    # issue 39: lbt-doctor --fit plans the run and each change that lowers its peak (titan/runtime/peak_fit.py)
    args = ["--training.local_batch_size", "8", "--training.seq_len", "512", "--memory.limit_gib", "0.3"]
    assert (
        doctor.main(["--config-file", "train_configs/debug_model.toml", "--fit", *args]) == 2
    )  # over the limit
    out = capsys.readouterr().out
    table = out[out.index("Planned peak of rank 0 against 0.92 x 0.30 GiB (memory.limit_gib = 0.3):") :]
    rows = [r.split(" | ") for r in table.splitlines() if r.startswith("| ") and r[2].isdigit()]
    assert [(r[1], r[2], r[-1]) for r in rows] == [
        ("`--activation_checkpoint selective`", "0.22", "yes |"),
        ("`--activation_checkpoint full`", "0.16", "yes |"),
        ("`--training.local_batch_size 4 --training.global_batch_size 8`", "0.28", "yes |"),
        ("`--training.local_batch_size 2 --training.global_batch_size 8`", "0.19", "yes |"),
        ("`--training.local_batch_size 1 --training.global_batch_size 8`", "0.14", "yes |"),
        ('`[[quantize.saved]] modules = ["layers.*"], format = "e4m3"`', "0.28", "no |"),
        (
            '`exp_avg = "e2m1_block128", exp_avg_sq = "int4_block128" in optimizer.param_groups[0] with '
            'optimizer_name = "LowBitAdamW"`',
            "0.39",
            "no |",
        ),
        ('`optimizer_name = "LowBitAdamW" in optimizer.param_groups[0] (int8 moments)`', "0.40", "no |"),
        ("`(as configured)`", "0.43", "no |"),
    ]


def test_nvfp4_torchao_runs_torchaos_nvfp4_modules_on_sm100_and_says_why_not_on_sm90(clean_env):
    # issue 38's "done when": backend torchao on simulated SM100 shows torchao's NVFP4 modules, no fallback line
    args = ["--quantize.recipe", "nvfp4_torchao", "--quantize.backend", "torchao"]
    checks = doctor.run_checks(str(DEBUG), args, {"NGPU": "1"}, hw=doctor.hardware("sm100"))
    rows = by_name(checks)
    assert (rows["config"].status, rows["backends"].status) == ("OK", "OK")
    assert rows["backends"].detail == (
        "on CUDA SM100: 1 x Linear [high]; 30 x torchao NVFP4Linear (nvfp4_torchao) [torchao]"
    )
    assert not [c for c in checks if c.name == "fallback"]
    # on an H100 the same plan is ours under auto, one fallback line saying why; backend torchao is refused
    auto = ["--quantize.recipe", "nvfp4_torchao", "--quantize.backend", "auto"]
    rows = by_name(doctor.run_checks(str(DEBUG), auto, {"NGPU": "1"}, hw=doctor.hardware("sm90")))
    assert rows["backends"].detail == "on CUDA SM90: 1 x Linear [high]; 30 x QuantLinear [emulate]"
    assert rows["fallback"].detail.endswith(
        ": emulated: NVFP4Linear kernels need CUDA SM100+, this is CUDA SM90"
    )
    rows = by_name(doctor.run_checks(str(DEBUG), args, {"NGPU": "1"}, hw=doctor.hardware("sm90")))
    assert rows["backends"].status == "FAIL" and rows["backends"].detail.startswith(
        "on CUDA SM90: quantize.backend = 'torchao': torchao runs none of this plan's quantized layers "
        "(layers.0.attention.qkv_linear.wqkv: emulated: NVFP4Linear kernels need CUDA SM100+, this is CUDA SM90)"
    )
