"""Run one configuration: locally through torchrun (as run_llama_train.sh does) or through submit.sh (slurm)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LAUNCH = "low_bits_training.titan.launch"


@dataclass(frozen=True)
class Result:
    """What became of one run."""

    folder: Path
    """Its dump folder (``metrics.jsonl`` is there when it trained)."""
    returncode: int
    """0 when it trained (or was submitted)."""


def torchrun_command(
    config_file: str, folder: Path, args: Sequence[str], nproc: int = 1, python: str = sys.executable
) -> list[str]:
    """The torchrun command run_llama_train.sh would run, with ``--dump_folder folder``."""
    return [
        python,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        "--local-ranks-filter=0",
        "--role=rank",
        "--tee=3",
        "-m",
        LAUNCH,
        "--config-file",
        config_file,
        "--dump_folder",
        str(folder),
        *args,
    ]


def local_env(nproc: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a local run: each rank an equal share of the cores (as run_llama_train.sh)."""
    env = dict(os.environ if base is None else base)
    if "OMP_NUM_THREADS" not in env or nproc > 1:
        env["OMP_NUM_THREADS"] = str(max((os.cpu_count() or 1) // nproc, 1))
    env.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    return env


def run_local(
    config_file: str, folder: Path, args: Sequence[str], nproc: int = 1, timeout: float | None = None
) -> Result:
    """Train one configuration to ``folder``; its output goes to ``folder/train.log``.

    Returns:
        The folder and torchrun's exit code (a failed run does not stop a sweep).
    """
    folder.mkdir(parents=True, exist_ok=True)
    cmd = torchrun_command(config_file, folder, args, nproc)
    with open(folder / "train.log", "w") as log:
        try:
            p = subprocess.run(
                cmd, cwd=REPO, env=local_env(nproc), stdout=log, stderr=subprocess.STDOUT, timeout=timeout
            )
            code = p.returncode
        except subprocess.TimeoutExpired:
            code = 124
    return Result(folder, code)


def submit(
    config_file: str,
    folder: Path,
    args: Sequence[str],
    nproc: int = 1,
    nnodes: int = 1,
    wandb_group: str | None = None,
) -> Result:
    """Submit one configuration with submit.sh; it trains into ``folder`` (RUN_NAME = the folder's name).

    Returns:
        The folder and submit.sh's exit code.
    """
    env = dict(
        os.environ,
        CONFIG_FILE=config_file,
        NGPU=str(nproc),
        NNODES=str(nnodes),
        OUTPUT_ROOT=str(folder.parent),
        RUN_NAME=folder.name,
    )
    if wandb_group:  # W&B names must be unique across sweeps: <sweep>-<point>
        env.update(
            WANDB_RUN_GROUP=wandb_group,
            WANDB_RUN_NAME=f"{wandb_group}-{folder.name}",
            WANDB_RUN_ID=f"{wandb_group}-{folder.name}",
        )
    p = subprocess.run([str(REPO / "submit.sh"), *args], cwd=REPO, env=env)
    return Result(folder, p.returncode)
