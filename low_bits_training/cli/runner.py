"""Run one configuration: locally through ``run_llama_train.sh`` (the user's own command, so the launcher's
checks, exit codes and per-rank thread share are the same) or through ``submit.sh`` (slurm)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path


def repo_root() -> Path:
    """The repository this package is in: ``run_llama_train.sh``, ``submit.sh``, ``train_configs/``. The
    package's parent folder, as this project installs itself (``pip install -e .``, ``scripts/ensure_venv.sh``).
    The one place that says so; ``REPO`` is its value."""
    return Path(__file__).resolve().parents[2]


REPO = repo_root()
TRAIN_SCRIPT = REPO / "run_llama_train.sh"


@dataclass(frozen=True)
class Result:
    """What became of one run."""

    folder: Path
    """Its dump folder (``metrics.jsonl`` is there when it trained)."""
    returncode: int
    """0 when it trained (or was submitted); the launcher's code otherwise (2 config, 3 non-finite stop, 4
    checkpoint, 1 crash, 124 timeout)."""


def train_command(folder: Path, args: Sequence[str]) -> list[str]:
    """The command that trains into ``folder``: ``run_llama_train.sh --dump_folder folder ARGS``."""
    return [str(TRAIN_SCRIPT), "--dump_folder", str(folder), *args]


def train_env(config_file: str, nproc: int = 1, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment ``run_llama_train.sh`` reads: CONFIG_FILE, NGPU, this interpreter, no set-up.

    With several processes OMP_NUM_THREADS is left to the script, which gives each rank an equal share of
    the cores.
    """
    env = dict(os.environ if base is None else base)
    env.update(CONFIG_FILE=str(config_file), NGPU=str(nproc), PYTHON=sys.executable, LBT_SKIP_SETUP="1")
    if nproc > 1:
        env.pop("OMP_NUM_THREADS", None)
    return env


def run_local(
    config_file: str,
    folder: Path,
    args: Sequence[str],
    nproc: int = 1,
    timeout: float | None = None,
    watch: Callable[[], None] | None = None,
) -> Result:
    """Train one configuration to ``folder``; its output goes to ``folder/train.log``.

    Args:
        watch: called about once a second while it runs (progress displays).

    Returns:
        The folder and the launcher's exit code (a failed run does not stop a sweep).
    """
    folder.mkdir(parents=True, exist_ok=True)
    deadline = None if timeout is None else time.monotonic() + timeout
    with open(folder / "train.log", "w") as log:
        p = subprocess.Popen(
            train_command(folder, args), cwd=REPO, env=train_env(config_file, nproc), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        while p.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                os.killpg(p.pid, 15)  # its own session: the launcher and every rank
                p.wait()
                return Result(folder, 124)
            if watch is not None:
                watch()
            time.sleep(1.0)
    return Result(folder, p.returncode)


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
