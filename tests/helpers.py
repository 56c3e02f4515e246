"""Run real training jobs from tests: torchrun on CPU ranks, the project's launcher, metrics read back."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import tomli_w

REPO = Path(__file__).resolve().parents[1]
DEBUG_TOML = REPO / "train_configs" / "debug_model.toml"


@dataclass
class Run:
    returncode: int
    log: str
    folder: Path

    @property
    def rows(self) -> list[dict]:
        from low_bits_training.titan.metrics import read_metrics

        return read_metrics(self.folder)

    @property
    def losses(self) -> dict[int, float]:
        return {
            r["step"]: r["loss_metrics/global_avg_loss"]
            for r in self.rows
            if "loss_metrics/global_avg_loss" in r
        }


def write_toml(path: Path, base: Path = DEBUG_TOML, **sections) -> Path:
    """A copy of ``base`` with ``sections`` merged in (``training={"steps": 4}``); returns ``path``."""
    data = tomllib.loads(base.read_text())
    for name, values in sections.items():
        if isinstance(values, dict) and isinstance(data.get(name), dict):
            data[name].update(values)
        else:
            data[name] = values
    path.write_text(tomli_w.dumps(data))
    return path


def free_port() -> int:
    """A free TCP port on the loopback interface (for process groups that tests start themselves)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_command(folder: Path, *args: str, nproc: int = 1, config: Path | None = None) -> list[str]:
    """The torchrun command line of ``train`` (small debug shape, metrics every step, no TensorBoard)."""
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0", "--local-ranks-filter=0", "--role=rank", "--tee=3",
        "-m", "low_bits_training.titan.launch", "--config-file", str(config or DEBUG_TOML),
        "--dump_folder", str(folder), "--training.local_batch_size", "2", "--training.seq_len", "128",
        "--metrics.log_freq", "1", "--metrics.no-enable-tensorboard", *args,
    ]  # fmt: skip


def train_env(nproc: int = 1, env: dict | None = None) -> dict:
    threads = "1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2")
    return dict(os.environ, OMP_NUM_THREADS=threads, **(env or {}))


def train(
    tmp_path: Path,
    *args: str,
    nproc: int = 1,
    config: Path | None = None,
    timeout: int = 600,
    check: bool = True,
    env: dict | None = None,
) -> Run:
    """Train with ``torchrun --nproc_per_node nproc`` into ``tmp_path/run`` (small debug shape by default).

    Extra ``args`` are command-line overrides. The markov corpus is shared across tests (repo assets folder).
    """
    folder = tmp_path / "run"
    cmd = train_command(folder, *args, nproc=nproc, config=config)
    p = subprocess.run(
        cmd, cwd=REPO, env=train_env(nproc, env), capture_output=True, text=True, timeout=timeout
    )
    run = Run(p.returncode, p.stdout + p.stderr, folder)
    if check and p.returncode != 0:
        raise AssertionError(f"training failed ({p.returncode}):\n{run.log[-6000:]}")
    return run
