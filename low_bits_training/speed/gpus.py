"""The GPUs the speed model knows: dense tensor-core peaks per dtype, HBM bandwidth, and which scaled GEMMs
each generation runs natively. Data only; every number's public source is in docs/speed_model.md.

Peaks are dense (no 2:4 sparsity) per GPU, in TFLOP/s; NVIDIA's spec sheets print most Blackwell figures
with sparsity and say dense is half. A dtype missing from ``peaks`` has no tensor-core path on that GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from low_bits_training.nn.hardware import Hardware

Dtype = str
"""A GEMM input dtype class: "bf16", "fp8", "fp6", "fp4" or "int8"."""

SCALED_FAMILIES: dict[str, dict[str, frozenset[str]]] = {
    "sm90": {
        "fp8": frozenset({"scaled", "block128"}),
        "int8": frozenset({"scaled"}),
    },
    "sm100": {
        "fp8": frozenset({"scaled", "block128", "mx32"}),
        "fp6": frozenset({"mx32"}),
        "fp4": frozenset({"mx32", "nv16"}),
        "int8": frozenset({"scaled"}),
    },
}
"""Per architecture: which scale families (``speed.model.scale_family``) a low-precision GEMM of each dtype
runs with natively. ``scaled`` = one scale per tensor or per row (``torch._scaled_mm``); ``block128`` =
DeepSeek's 1x128 / 128x128 blocks (DeepGEMM, Transformer Engine's Float8BlockScaling; emulated through MXFP8
kernels on Blackwell, at the fp8 rate); ``mx32`` = OCP MX 1x32 blocks with e8m0 scales; ``nv16`` = NVFP4's
1x16 blocks with ue4m3 scales. A 2-D tile of side 32 / 16 / 128 runs as the 1-D block of its family."""


@dataclass(frozen=True)
class GpuSpec:
    """One GPU as the speed model sees it."""

    name: str
    arch: str
    """"sm90" (Hopper) or "sm100" (Blackwell): the row of ``SCALED_FAMILIES``."""
    capability: tuple[int, int]
    """The compute capability the precision plan is resolved for (``nn.hardware.Hardware``); B300 /
    GB300 report 10.3 but resolve as 10.0 does here."""
    peaks: dict[Dtype, float] = field(default_factory=dict)
    """Dense tensor-core TFLOP/s (TOP/s for int8) per dtype."""
    hbm_tb_s: float = 0.0
    """HBM bandwidth, TB/s."""
    source: str = ""
    """Where the figures come from (short; the URLs are in docs/speed_model.md)."""
    fp32: float = 0.0
    """Non-tensor-core fp32 TFLOP/s: where an emulated GEMM whose operands are not bf16 numbers runs (torch
    multiplies fp32 on the CUDA cores unless TF32 is allowed, and it is not by default)."""

    def peak(self, dtype: Dtype) -> float:
        """Dense peak in FLOP/s of ``dtype`` (0.0: no tensor-core path; "fp32": the CUDA cores')."""
        return (self.fp32 if dtype == "fp32" else self.peaks.get(dtype, 0.0)) * 1e12

    def runs(self, dtype: Dtype, family: str) -> bool:
        """Whether a ``dtype`` GEMM with scales of ``family`` runs natively here."""
        return dtype in self.peaks and family in SCALED_FAMILIES[self.arch].get(dtype, frozenset())

    def hardware(self, torchao: bool = True) -> Hardware:
        """The ``Hardware`` the precision plan is resolved on for this GPU (backends as on that GPU)."""
        return Hardware("cuda", self.capability, torchao, gpu=self.name)


def _hopper(name: str, bf16: float, hbm: float, fp32: float, source: str) -> GpuSpec:
    # Hopper: fp8 and int8 at twice the bf16 rate; no fp6 / fp4 tensor cores.
    peaks = {"bf16": bf16, "fp8": 2 * bf16, "int8": 2 * bf16}
    return GpuSpec(name, "sm90", (9, 0), peaks, hbm, source, fp32)


def _blackwell(name: str, bf16: float, fp4: float, int8: float, fp32: float, source: str) -> GpuSpec:
    # Blackwell: fp8 and fp6 at twice the bf16 rate; HBM3e 8 TB/s on every part listed.
    peaks = {"bf16": bf16, "fp8": 2 * bf16, "fp6": 2 * bf16, "fp4": fp4, "int8": int8}
    return GpuSpec(name, "sm100", (10, 0), peaks, 8.0, source, fp32)


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        _hopper("H100", 989.4, 3.35, 67.0, "NVIDIA H100 SXM datasheet"),
        _hopper("H200", 989.4, 4.8, 67.0, "NVIDIA H200 SXM datasheet"),
        _hopper("H200-NVL", 835.5, 4.8, 60.0, "NVIDIA H200 NVL datasheet (PCIe card, 600 W)"),
        _blackwell("B200", 2250.0, 9000.0, 4500.0, 75.0, "NVIDIA HGX B200 (8-GPU board figures / 8)"),
        _blackwell("GB200", 2500.0, 10000.0, 5000.0, 80.0, "NVIDIA GB200 NVL72 (72-GPU rack figures / 72)"),
        _blackwell("B300", 2250.0, 13500.0, 150.0, 75.0, "NVIDIA HGX B300 (8-GPU board figures / 8)"),
        _blackwell("GB300", 2500.0, 15000.0, 165.0, 80.0, "NVIDIA GB300 NVL72 (72-GPU rack figures / 72)"),
    )
}
"""Every GPU the model knows, by name (``lbt-speed --gpu``)."""


def gpu(name: str) -> GpuSpec:
    """The GPU named ``name`` (case-insensitive).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    for key, spec in GPUS.items():
        if key.lower() == name.lower():
            return spec
    raise ValueError(f"unknown GPU {name!r}: expected one of {', '.join(GPUS)}")


def gpu_for_device(device_name: str) -> GpuSpec | None:
    """The table's GPU for a CUDA device name (``torch.cuda.get_device_name``: "NVIDIA H100 80GB HBM3",
    "NVIDIA B200", ...); None for a GPU the model does not know."""
    name = device_name.upper()
    for key in ("GB300", "GB200", "B300", "B200", "H200-NVL", "H200", "H100"):
        parts = key.split("-")
        if all(p in name for p in parts):
            return GPUS[key]
    return None
