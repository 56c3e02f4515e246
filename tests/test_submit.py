"""submit.sh + scripts/slurm/train.sbatch against fake ``sbatch`` / ``srun`` / ``scontrol`` on PATH.

The fakes record their arguments and environment as JSON lines; the fake sbatch then runs the batch script the
way slurm would (SLURM_* variables set, cwd the submit directory), so the whole chain down to the torchrun
command line is checked without a cluster.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import CORPUS

REPO = Path(__file__).resolve().parents[1]
SECRET = "wandb-secret-value-1234567890"

_FAKE_SBATCH = """#!{py}
import json, os, subprocess, sys
args = sys.argv[1:]
opts = dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)
script_at = next(i for i, a in enumerate(args) if not a.startswith("--"))
with open({log!r}, "a") as f:
    f.write(json.dumps({{"cmd": "sbatch", "args": args, "env": dict(os.environ)}}) + "\\n")
env = dict(os.environ, SLURM_JOB_ID="4242", SLURM_JOB_NODELIST="node[01-{nn:02d}]",
           SLURM_JOB_NUM_NODES=opts["nodes"], SLURM_GPUS_PER_NODE=os.environ.get("FAKE_GPUS", opts["gpus-per-node"]),
           SLURM_SUBMIT_DIR=os.getcwd())
sys.exit(subprocess.call(["bash", args[script_at], *args[script_at + 1:]], env=env))
"""
_FAKE_SRUN = """#!{py}
import json, os, sys
with open({log!r}, "a") as f:
    f.write(json.dumps({{"cmd": "srun", "args": sys.argv[1:], "env": dict(os.environ)}}) + "\\n")
"""
_FAKE_SCONTROL = """#!/usr/bin/env bash
set -euo pipefail
[[ "$1 $2" == "show hostnames" ]] || exit 3
echo "$3" >> {log!r}.scontrol
for i in $(seq 1 {nn}); do printf 'node%02d\\n' "$i"; done
"""


@pytest.fixture
def slurm(tmp_path):
    """Fake slurm on PATH; returns a function that runs submit.sh and the list of recorded calls."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.jsonl"
    bin_dir.mkdir()
    (tmp_path / ".env").write_text(
        f"# mine\nexport WANDB_API_KEY={SECRET}\nSBATCH_PARTITION=h100\nMY_VAR='x y'\n"
    )

    def submit(*args: str, nnodes: int = 2, **env: str):
        for name, text in (("sbatch", _FAKE_SBATCH), ("srun", _FAKE_SRUN), ("scontrol", _FAKE_SCONTROL)):
            (bin_dir / name).write_text(text.format(py=sys.executable, log=str(log), nn=nnodes))
            (bin_dir / name).chmod(0o755)
        base = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("WANDB", "SBATCH", "SLURM", "LBT_"))
            and k not in ("RUN_NAME", "NGPU", "NNODES", "OMP_NUM_THREADS")
        }
        full = dict(
            base,
            PATH=f"{bin_dir}:{os.environ['PATH']}",
            PYTHON=sys.executable,
            NNODES=str(nnodes),
            OUTPUT_ROOT=str(tmp_path / "outputs"),
            ENV_FILE=str(tmp_path / ".env"),
            LBT_SECRETS_DIR=str(tmp_path / "secrets"),
            **env,
        )
        corpus = (
            "--dataloader.dataset_path",
            str(CORPUS),
        )  # submit.sh's check builds it: not in the checkout
        p = subprocess.run(
            [str(REPO / "submit.sh"), *args, *corpus],
            cwd=tmp_path,
            env=full,
            capture_output=True,
            text=True,
            timeout=300,  # the launcher's config check runs first (imports torch and torchtitan)
        )
        calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        log.unlink(missing_ok=True)
        return p, calls

    return submit


def test_exact_sbatch_and_srun_commands(slurm, tmp_path):
    p, calls = slurm("--training.steps", "10", RUN_NAME="fp8-test", NGPU="4")
    assert p.returncode == 0, p.stderr
    assert [c["cmd"] for c in calls] == ["sbatch", "srun"]
    out = tmp_path / "outputs" / "fp8-test"
    sb, sr = calls
    assert sb["args"] == [
        "--job-name=fp8-test",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--gpus-per-node=4",
        f"--output={out}/slurm/%j.out",
        "--open-mode=append",
        "--requeue",
        "--export=ALL",
        "scripts/slurm/train.sbatch",
        "--training.steps",
        "10",
        "--dataloader.dataset_path",
        str(CORPUS),
    ]
    assert sr["args"] == [
        "--nodes=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        sys.executable,
        "-m",
        "low_bits_training.cli.train",  # the launcher with the speed notes (tests/cli/test_train.py)
        "--nnodes=2",
        "--nproc_per_node=4",
        "--max-restarts=0",
        "--rdzv_id=4242",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=node01:29500",
        "--local-ranks-filter=0",
        "--role=rank",
        "--tee=3",
        "--",
        "--config-file",
        "train_configs/debug_model.toml",
        "--job.name",
        "fp8-test",
        "--dump_folder",
        str(out),
        "--checkpoint.enable",
        "--training.steps",
        "10",
        "--dataloader.dataset_path",
        str(CORPUS),
    ]
    assert (tmp_path / "calls.jsonl.scontrol").read_text().split() == ["node[01-02]"]
    for c in calls:  # what both sides see
        assert (
            c["env"]["LBT_RUN_NAME"] == c["env"]["WANDB_RUN_NAME"] == c["env"]["WANDB_RUN_ID"] == "fp8-test"
        )
        assert c["env"]["LBT_DUMP_FOLDER"] == str(out)
        assert c["env"]["SBATCH_PARTITION"] == "h100" and c["env"]["MY_VAR"] == "x y"
    # The secret is not in what sbatch records, reaches the training processes, and is never printed.
    assert "WANDB_API_KEY" not in sb["env"]
    assert sr["env"]["WANDB_API_KEY"] == SECRET
    assert sr["env"]["OMP_NUM_THREADS"] == "1"
    assert SECRET not in p.stdout + p.stderr
    assert out.is_dir()


SHELL_SECRET = "hf-shell-secret-0987654321"


def test_secrets_exported_in_the_shell_stay_out_of_what_sbatch_records(slurm, tmp_path):
    p, calls = slurm(RUN_NAME="shell-secrets", NGPU="1", HF_TOKEN=SHELL_SECRET, MY_API_KEY="k e y'$x")
    assert p.returncode == 0, p.stderr
    sb, sr = calls
    recorded = json.dumps(sb)
    assert SHELL_SECRET not in recorded and "k e y" not in recorded and SECRET not in recorded
    assert not {"HF_TOKEN", "MY_API_KEY", "WANDB_API_KEY"} & set(sb["env"])
    # the nodes get them, values intact (quoting), from a file only its owner can read
    assert sr["env"]["HF_TOKEN"] == SHELL_SECRET and sr["env"]["MY_API_KEY"] == "k e y'$x"
    assert sr["env"]["WANDB_API_KEY"] == SECRET
    secrets = tmp_path / "secrets" / "shell-secrets.env"
    assert sb["env"]["LBT_SECRETS_FILE"] == str(secrets)
    assert secrets.stat().st_mode & 0o777 == 0o600
    assert SHELL_SECRET not in p.stdout + p.stderr


def test_resubmit_same_name_same_folder_and_says_resume(slurm, tmp_path):
    p1, first = slurm(RUN_NAME="long-run", NGPU="8")
    (tmp_path / "outputs" / "long-run" / "checkpoint" / "step-100").mkdir(parents=True)
    p2, second = slurm(RUN_NAME="long-run", NGPU="8")
    assert p1.returncode == p2.returncode == 0, p2.stderr
    folder = lambda calls: calls[1]["args"][calls[1]["args"].index("--dump_folder") + 1]  # noqa: E731
    assert folder(first) == folder(second) == str(tmp_path / "outputs" / "long-run")
    assert first[0]["args"] == second[0]["args"]
    assert "resumes from its last checkpoint" in p2.stderr and "resumes" not in p1.stderr


@pytest.mark.parametrize(
    "env, pattern",
    [
        ({}, r"debug_model-\d{8}-\d{6}"),
        ({"WANDB_NAME": "from-wandb"}, r"from-wandb"),
        ({"WANDB_RUN_NAME": "wb-run", "WANDB_NAME": "other"}, r"wb-run"),
    ],
)
def test_run_name_from_wandb_or_generated(slurm, env, pattern):
    p, calls = slurm(nnodes=1, NGPU="2", **env)
    assert p.returncode == 0, p.stderr
    name = calls[0]["args"][0].removeprefix("--job-name=")
    assert re.fullmatch(pattern, name)
    assert calls[1]["args"][calls[1]["args"].index("--job.name") + 1] == name


def test_gpu_type_in_slurm_count(slurm):
    p, calls = slurm(nnodes=1, RUN_NAME="typed", NGPU="8", FAKE_GPUS="h100:8")
    assert p.returncode == 0, p.stderr
    assert "--nproc_per_node=8" in calls[1]["args"] and "--nnodes=1" in calls[1]["args"]


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RUN_NAME": "a/b"}, "RUN_NAME = 'a/b'"),
        ({"NGPU": "0"}, "NGPU = '0'"),
        ({"CONFIG_FILE": "nope.toml"}, "CONFIG_FILE = 'nope.toml': no such file"),
    ],
)
def test_bad_input_is_one_line_and_submits_nothing(slurm, env, message):
    p, calls = slurm(**env)
    assert p.returncode == 2 and calls == []
    assert message in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_dry_run_prints_sbatch_command_without_secret(slurm, tmp_path):
    p, calls = slurm(RUN_NAME="dry", DRY_RUN="1", nnodes=1, HF_TOKEN=SHELL_SECRET)
    assert p.returncode == 0 and calls == [], p.stderr
    assert p.stdout.startswith("sbatch --job-name=dry ") and SECRET not in p.stdout + p.stderr
    assert "--gpus-per-node=1 " in p.stdout  # the default: one process per node, as the debug model needs
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "secrets").exists()  # nothing written


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--training.stepz", "3"], {}, "config error: unknown flag '--training.stepz'"),
        (["--parallelism.data_parallel_shard_degree", "2"], {"NGPU": "3"}, "NGPU x nodes = 3 processes"),
    ],
)
@pytest.mark.parametrize("dry", ["0", "1"])
def test_the_config_is_checked_as_the_launcher_does_before_anything_is_written(
    slurm, tmp_path, args, env, message, dry
):
    p, calls = slurm(*args, RUN_NAME="bad", DRY_RUN=dry, nnodes=1, **env)
    assert p.returncode == 2 and calls == [] and p.stdout == ""
    assert message in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "secrets").exists()
