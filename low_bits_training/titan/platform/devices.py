"""Which accelerator this machine has, as the launcher, the workers, ``lbt-doctor`` and ``scripts/gpu_check.sh``
all ask it (torch and the standard library only, so it imports on any torch, before torchtitan).

A GPU node whose NVIDIA driver is older than torch's CUDA build (``torch==2.14.1`` from the registry is a
CUDA 13 build: driver >= 580) has a driver and no CUDA: torch then runs on the CPU without a word. Every
entry point refuses that in one line (``cuda_refusal``) instead of training on the node's CPU, whatever the
number of processes; ``ALLOW_CPU_RANKS`` is the one way to train there anyway.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")
"""Where the NVIDIA kernel module states its version (Linux)."""
ALLOW_CPU_RANKS = "LBT_ALLOW_CPU_RANKS"
"""Set to 1 to train on the CPU where the launcher or a rank would refuse it: a machine with an NVIDIA driver
on which torch sees no GPU (``cuda_refusal``), or several CPU ranks of a large model (the launcher's
``accelerator_refusal``)."""


def nvidia_driver() -> str | None:
    """The NVIDIA kernel driver this machine has (its version line, or "nvidia-smi" when only that is found),
    or None: a sign the user meant GPUs."""
    if DRIVER_VERSION_FILE.is_file():
        return DRIVER_VERSION_FILE.read_text(errors="replace").splitlines()[0].strip()
    return "nvidia-smi" if shutil.which("nvidia-smi") else None


def cuda_refusal(driver: str | None, cuda_available: bool, cuda_build: str | None) -> str | None:
    """Why a machine with an NVIDIA driver on which torch sees no GPU must not run (None: nothing wrong).

    Args:
        driver: ``nvidia_driver()``.
        cuda_available: ``torch.cuda.is_available()``.
        cuda_build: the CUDA version torch is built for (``torch.version.cuda``; None: a CPU-only build).

    Returns:
        One line naming the driver, the torch build and what to do, or None.
    """
    if driver is None or cuda_available:
        return None
    build = f"a CUDA {cuda_build} build" if cuda_build else "a CPU-only build"
    return (
        f"this machine has an NVIDIA driver ({driver}) but torch sees no GPU (torch is {build}); install a "
        "torch build this driver runs (nvidia-smi names the newest CUDA it supports) and keep it with "
        "LBT_TORCH=keep (README 'Setup on a GPU machine or cluster'), check CUDA_VISIBLE_DEVICES, or set "
        f"{ALLOW_CPU_RANKS}=1 to train on this machine's CPU anyway"
    )


def this_machine_refusal(env: Mapping[str, str] | None = None) -> str | None:
    """``cuda_refusal`` for this machine and the torch imported here (None also where ``env`` sets
    ``ALLOW_CPU_RANKS`` to 1; ``env`` defaults to ``os.environ``)."""
    import torch

    if (os.environ if env is None else env).get(ALLOW_CPU_RANKS) == "1":
        return None
    return cuda_refusal(nvidia_driver(), torch.cuda.is_available(), torch.version.cuda)


def gpu_count_refusal(per_node: int, visible: int, cuda_visible_devices: str | None) -> str | None:
    """Why ``per_node`` processes on this machine cannot each have a GPU of the ``visible`` ones (each rank
    would die in ``set_device``), or None: they can, or there is no GPU (the ranks run on the CPU).

    The launcher refuses with it before any rank starts; ``lbt-doctor``'s "gpu count" row shows it.

    Args:
        per_node: processes per node (``NGPU``, torchrun's ``--nproc_per_node``).
        visible: ``torch.cuda.device_count()`` (0 where torch sees no GPU).
        cuda_visible_devices: ``$CUDA_VISIBLE_DEVICES`` (None: unset).

    Returns:
        One line naming NGPU, the visible GPUs and what to do, or None.
    """
    if visible == 0 or per_node <= visible:
        return None
    shown = " unset" if cuda_visible_devices is None else f"={cuda_visible_devices!r}"
    return (
        f"NGPU = {per_node}: only {visible} GPU(s) visible on this machine (CUDA_VISIBLE_DEVICES{shown}); "
        f"allowed: NGPU <= {visible} (export NGPU={visible}), or widen CUDA_VISIBLE_DEVICES"
    )
