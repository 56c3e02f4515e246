"""Environment checks for ``lbt-doctor``: each returns one ``Check`` (a verdict and a one-line fix).

The checks read the environment they are given (``env``) so tests can change it without touching the
process; none of them prints or returns a credential.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal

from low_bits_training.run.secrets import wandb_credentials
from low_bits_training.titan.platform.devices import gpu_count_refusal, this_machine_refusal

Status = Literal["OK", "WARN", "FAIL"]
PINNED = {"torch": "2.14.1", "torchtitan": "0.3.0", "torchao": "0.18.0"}
MIN_NCCL = (2, 23, 4)  # older NCCL segfaults on H100


@dataclass(frozen=True)
class Check:
    """One line of the doctor's table."""

    name: str
    """What was checked (``cuda``, ``nccl``, ``format fp8_rowwise`` ...)."""
    status: Status
    """OK: fine. WARN: runs, but slower or without something. FAIL: the job would not run as asked."""
    detail: str
    """What was found."""
    fix: str = ""
    """One line: what to do about it (empty when OK)."""


def check_versions() -> list[Check]:
    """The pinned stack (DESIGN.md): a different torch/torchtitan/torchao is a FAIL for torch, else WARN.

    Returns:
        One check per package.
    """
    out = []
    for pkg, want in PINNED.items():
        try:
            have = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out.append(Check(pkg, "FAIL", "not installed", "pip install -e . (installs the pinned stack)"))
            continue
        if have.split("+")[0] == want:
            out.append(Check(pkg, "OK", have))
        else:
            status: Status = "FAIL" if pkg == "torch" and _numbers(have) < _numbers(want) else "WARN"
            out.append(Check(pkg, status, f"{have}, pinned {want}", f"pip install {pkg}=={want}"))
    return out


def _numbers(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("+")[0].split(".")[:3] if x.isdigit())


def _driver_version() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        p = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else None


def check_cuda() -> Check:
    """CUDA runtime, driver and devices; no GPU means every format is emulated on the CPU."""
    import torch

    if not torch.cuda.is_available():
        refused = this_machine_refusal()
        if refused:  # a GPU node whose torch cannot use its driver: the launcher refuses it too
            return Check("cuda", "FAIL", refused, "see the line (README 'Setup on a GPU machine or cluster')")
        build = f"CUDA build {torch.version.cuda}" if torch.version.cuda else "CPU build"
        return Check(
            "cuda",
            "WARN",
            f"no GPU visible ({build}): training runs on CPU, every format emulated",
            "fine for tests and numerics; for speed run on a GPU node (check CUDA_VISIBLE_DEVICES)",
        )
    names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
    cap = torch.cuda.get_device_capability(0)
    driver = _driver_version() or "unknown"
    return Check(
        "cuda", "OK", f"CUDA {torch.version.cuda}, driver {driver}, {', '.join(names)} (SM{cap[0]}{cap[1]})"
    )


def check_nccl() -> Check:
    """NCCL >= 2.23.4 on GPUs (older ones segfault on H100); not used on CPU (gloo)."""
    import torch

    if not torch.cuda.is_available():
        return Check("nccl", "OK", "not used without a GPU (gloo)")
    try:
        have = tuple(torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):
        return Check("nccl", "FAIL", "torch has no NCCL", "install a CUDA build of torch")
    text = ".".join(map(str, have))
    if have < MIN_NCCL:
        return Check(
            "nccl",
            "FAIL",
            f"{text}: older than 2.23.4 segfaults on H100",
            "pip install -U 'nvidia-nccl-cu12>=2.23.4'",
        )
    return Check("nccl", "OK", text)


def check_gpu_count(env: Mapping[str, str]) -> Check:
    """NGPU (processes per node) against the GPUs torch sees and CUDA_VISIBLE_DEVICES (more than visible: the
    launcher's own refusal, ``devices.gpu_count_refusal``)."""
    import torch

    ngpu, visible = env.get("NGPU"), env.get("CUDA_VISIBLE_DEVICES")
    if ngpu is not None and not ngpu.isdigit():
        return Check("gpu count", "FAIL", f"NGPU = {ngpu!r}: not a number", "export NGPU=<GPUs per node>")
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    shown = f"CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "CUDA_VISIBLE_DEVICES unset"
    if have == 0:
        n = ngpu or "1"
        return Check("gpu count", "OK", f"no GPU; NGPU={n} -> {n} CPU process(es) on gloo ({shown})")
    if ngpu is None:
        return Check("gpu count", "OK", f"{have} GPU(s); NGPU unset -> {have} processes ({shown})")
    too_many = gpu_count_refusal(int(ngpu), have, visible)  # the launcher's refusal: one home
    if too_many:
        return Check("gpu count", "FAIL", too_many, f"export NGPU={have} or widen CUDA_VISIBLE_DEVICES")
    if int(ngpu) < have:
        return Check(
            "gpu count",
            "WARN",
            f"NGPU={ngpu} uses {ngpu} of {have} visible GPUs ({shown})",
            f"export NGPU={have} to use them all",
        )
    return Check("gpu count", "OK", f"NGPU={ngpu} = {have} visible GPU(s)")


def check_wandb(env: Mapping[str, str], enabled_in_config: bool = False) -> Check:
    """W&B credentials, judged by the launcher's own test (``run.secrets.wandb_credentials``: an API key,
    ``WANDB_MODE`` or a netrc entry; the key is never shown): missing is a WARN (metrics still go to
    metrics.jsonl), a FAIL if the config asks for W&B."""
    source = wandb_credentials(env)
    if source is not None:
        return Check("wandb", "OK", f"configured ({source})")
    status: Status = "FAIL" if enabled_in_config else "WARN"
    why = (
        "metrics.enable_wandb is set" if enabled_in_config else "metrics go to metrics.jsonl/TensorBoard only"
    )
    return Check(
        "wandb",
        status,
        f"not configured: {why}",
        "wandb login, or WANDB_API_KEY=... in .env (never commit it)",
    )


def free_bytes(path: str | os.PathLike) -> tuple[Path, int]:
    """Free bytes on the filesystem that holds ``path`` (its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists():
        p = p.parent
    return p, shutil.disk_usage(p).free


def check_disk(path: str | os.PathLike, need_bytes: int | None, threshold: int = 50 * 2**30) -> Check:
    """Free disk at the checkpoint folder against an estimate (or ``threshold`` when there is none)."""
    where, free = free_bytes(path)
    gib = free / 2**30
    if need_bytes is None:
        status: Status = "OK" if free >= threshold else "WARN"
        return Check(
            "disk",
            status,
            f"{gib:.1f} GiB free at {where} (no size estimate; want {threshold / 2**30:.0f})",
            "" if status == "OK" else "free space or point dump_folder elsewhere",
        )
    need = need_bytes / 2**30
    if free < need_bytes:
        return Check(
            "disk",
            "FAIL",
            f"{gib:.1f} GiB free at {where}, checkpoints need ~{need:.1f} GiB",
            "free space, lower checkpoint.keep_latest_k, or move dump_folder",
        )
    status = "OK" if free >= 2 * need_bytes else "WARN"
    return Check(
        "disk",
        status,
        f"{gib:.1f} GiB free at {where}, checkpoints need ~{need:.2f} GiB",
        "" if status == "OK" else "little headroom: free space or lower checkpoint.keep_latest_k",
    )
