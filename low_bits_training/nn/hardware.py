"""What this device offers the backend choice: its kind, compute capability, torchao, torchao's MXFP8 cast
kernel and Triton (``Hardware``), detected for this process (``detect_hardware``) or named (lbt-doctor
``--hardware``, tests). The plan's backend policy (``plan.backends``) reads it; nothing here decides."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal

from low_bits_training.upstream import has_kernel, has_triton


@dataclass(frozen=True)
class Hardware:
    """What a device offers the backend choice: detected (``detect_hardware``) or named (doctor, tests)."""

    kind: Literal["cpu", "cuda"] = "cpu"
    capability: tuple[int, int] | None = None
    """CUDA compute capability (9, 0) for H100, (10, 0) for B200; None on CPU."""
    torchao: bool = True
    """torchao is importable (training also needs torchtitan, which the launcher always has)."""
    mxfp8_cuda_cast: bool = True
    """torchao's compiled extension has the MXFP8 dim-1 cast kernel (``torch.ops.torchao.mxfp8_quantize``
    with a CUDA kernel: torchao built for this torch, CUDA >= 12.8, SM100). Named hardware (doctor, tests)
    assumes it; ``detect_hardware`` checks it."""
    triton: bool = True
    """Triton can compile for this device (torchao's Triton casts; torch's probe, ``upstream.has_triton``)."""
    gpu: str | None = None
    """The GPU this names, as the speed model knows it (``speed.gpus.GPUS``: "H200"), when one was named
    (``lbt-doctor --hardware h200``); None: the architecture alone (detected, or named as ``sm90``)."""

    def has(self, need: tuple[int, int]) -> bool:
        """True on a CUDA device of at least compute capability ``need``."""
        return self.kind == "cuda" and self.capability is not None and self.capability >= need

    def __str__(self) -> str:
        return "CPU" if self.capability is None else f"CUDA SM{self.capability[0]}{self.capability[1]}"


def detect_hardware() -> Hardware:
    """The hardware this process runs on (the first CUDA device, or the CPU)."""
    import torch

    have_ao = importlib.util.find_spec("torchao") is not None
    if not torch.cuda.is_available():
        return Hardware("cpu", None, have_ao, mxfp8_cuda_cast=False, triton=False)
    capability = tuple(torch.cuda.get_device_capability(0))
    return Hardware("cuda", capability, have_ao, have_ao and mxfp8_cuda_cast_built(), has_triton())


def mxfp8_cuda_cast_built() -> bool:
    """True when ``torch.ops.torchao.mxfp8_quantize`` exists with a CUDA kernel. torchao defines the op's
    schema on SM100 with CUDA >= 12.8 (prototype/mx_formats/kernels.py) and its compiled extension registers
    the kernel (it does so on any machine: a kernel without a schema is no op); where the extension did not
    load for this torch build, torchao only warns, and the first backward of an MXFP8 layer would raise (torch's
    private dispatcher probe, through ``low_bits_training/upstream.py``)."""
    import torch

    try:
        import torchao.prototype.mx_formats.kernels  # noqa: F401  (defines the op where it can exist)

        defined = hasattr(torch.ops.torchao, "mxfp8_quantize")  # the schema: only where torchao defines it
        return defined and has_kernel("torchao::mxfp8_quantize", "CUDA")
    except (ImportError, RuntimeError):  # RuntimeError: the op is not defined here
        return False
