"""Run real training jobs from tests: torchrun on CPU ranks, the project's launcher, metrics read back."""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import tomllib
from dataclasses import dataclass
from pathlib import Path

import tomli_w
import torch

REPO = Path(__file__).resolve().parents[1]
DEBUG_TOML = REPO / "train_configs" / "debug_model.toml"


@dataclass
class Run:
    returncode: int
    log: str
    folder: Path

    @property
    def rows(self) -> list[dict]:
        from low_bits_training.run.folder import read_metrics

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


def leave_worker() -> None:
    """End a 2-rank worker process that a test started itself (spawn or torchrun): barrier, destroy the
    process group, flush, and exit 0 without the interpreter's teardown. At teardown a native thread left
    by the gloo / DTensor stack aborted a rank about 1 run in 15 ("terminate called without an active
    exception", SIGABRT) after all its work was done and checked (the class of teardown crash of pytorch
    PR 179291); a worker's results are already asserted or saved when it calls this."""
    import sys

    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


CORPUS = Path(tempfile.mkdtemp(prefix="lbt-test-corpus-")) / "lbt_markov"
_OWNER = os.getpid()
atexit.register(lambda: os.getpid() == _OWNER and shutil.rmtree(CORPUS.parent, True))  # not in a forked child
"""The built-in corpus of this test process's training runs (built by the first, read by the rest): never the
checkout's ``assets/`` (tests/conftest.py, ``leaves_the_checkout_alone``)."""

SMALL = (
    "--training.local_batch_size", "2", "--training.seq_len", "128", "--metrics.log_freq", "1",
    "--metrics.no-enable-tensorboard", "--dataloader.dataset_path", str(CORPUS),
)  # fmt: skip
"""The small debug shape every test run uses unless it overrides it; the corpus in ``CORPUS``."""


def train_command(folder: Path, *args: str) -> list[str]:
    """The command line of ``train``: ``run_llama_train.sh`` (the launcher, as users run it) with the small
    shape; the process count and the config go through the environment (``train_env``)."""
    from low_bits_training.cli.runner import train_command as command

    return command(folder, [*SMALL, *args])


def train_env(nproc: int = 1, env: dict | None = None, config: Path | None = None) -> dict:
    """The environment of ``train_command``: CONFIG_FILE, NGPU, this interpreter, 1-2 threads per rank."""
    from low_bits_training.cli.runner import train_env as environment

    out = environment(str(config or DEBUG_TOML), nproc, dict(os.environ, **(env or {})))
    out["OMP_NUM_THREADS"] = "1" if nproc > 1 else os.environ.get("OMP_NUM_THREADS", "2")
    return out


def train(
    tmp_path: Path,
    *args: str,
    nproc: int = 1,
    config: Path | None = None,
    timeout: int = 600,
    check: bool = True,
    env: dict | None = None,
) -> Run:
    """Train with ``run_llama_train.sh`` (NGPU = nproc) into ``tmp_path/run`` (small debug shape by default).

    Extra ``args`` are command-line overrides. The markov corpus is shared across this process's tests (``CORPUS``).
    ``returncode`` is the launcher's: 2 config, 3 non-finite stop, 4 checkpoint, 1 crash.
    """
    folder = tmp_path / "run"
    cmd = train_command(folder, *args)
    p = subprocess.Popen(
        cmd, cwd=REPO, env=train_env(nproc, env, config), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # its own session: the launcher and every rank, not the script alone
        out, err = p.communicate()
        raise AssertionError(f"training timed out after {timeout} s:\n{(out + err)[-6000:]}") from None
    run = Run(p.returncode, out + err, folder)
    if check and p.returncode != 0:
        raise AssertionError(f"training failed ({p.returncode}):\n{run.log[-6000:]}")
    return run


class Scaled(torch.nn.Module):
    """``x * k``: compiled once per ``k`` (dynamo guards on the Python int, as on a QuantLinear's plan)."""

    def __init__(self, k: int):
        super().__init__()
        self.k = k

    def forward(self, x):
        return x * self.k
