"""Predict a step: every target's GEMMs and casts on one GPU, summed into the step speedup over bf16."""

from __future__ import annotations

from dataclasses import dataclass

from low_bits_training.nn.roles import GEMMS, ROLE_NAMES

from .casts import tensor_cast
from .gpus import GpuSpec
from .model import (
    EMULATED_BACKENDS,
    GemmTarget,
    emulated_gemm_dtype,
    gemm_dtype,
    gemm_io_bytes,
    gemm_seconds,
    operands,
)
from .params import PARAMS, SpeedParams

TENSORS = ("input", "weight", "grad_output")


@dataclass(frozen=True)
class GemmRow:
    """One GEMM of one target."""

    gemm: str
    dtype: str
    flops: float
    """FLOPs per step (recomputed runs included)."""
    seconds: float
    bf16_seconds: float


@dataclass(frozen=True)
class TargetRow:
    """One target: its three GEMMs and its casts."""

    target: GemmTarget
    gemms: tuple[GemmRow, ...]
    cast_bytes: float
    cast_seconds: float

    @property
    def seconds(self) -> float:
        return sum(g.seconds for g in self.gemms)

    @property
    def bf16_seconds(self) -> float:
        return sum(g.bf16_seconds for g in self.gemms)


@dataclass(frozen=True)
class Prediction:
    """A step of a plan on one GPU, against the same step in bf16."""

    gpu: str
    rows: tuple[TargetRow, ...]
    params: SpeedParams

    @property
    def bf16_gemm_seconds(self) -> float:
        """G_bf16: every GEMM of the step in bf16."""
        return sum(r.bf16_seconds for r in self.rows)

    @property
    def gemm_seconds(self) -> float:
        """G: the plan's GEMMs."""
        return sum(r.seconds for r in self.rows)

    @property
    def cast_seconds(self) -> float:
        """C: the plan's casts."""
        return sum(r.cast_seconds for r in self.rows)

    @property
    def bf16_step_seconds(self) -> float:
        """T_bf16 = G_bf16 / (1 - s)."""
        return self.bf16_gemm_seconds / (1.0 - self.params.nongemm_share)

    @property
    def other_seconds(self) -> float:
        """The non-GEMM time s * T_bf16, the same under every plan."""
        return self.params.nongemm_share * self.bf16_step_seconds

    @property
    def step_seconds(self) -> float:
        """T = G + C + s * T_bf16."""
        return self.gemm_seconds + self.cast_seconds + self.other_seconds

    @property
    def speedup(self) -> float:
        """Step speedup over bf16."""
        return self.bf16_step_seconds / self.step_seconds

    @property
    def ceiling(self) -> float:
        """The Amdahl ceiling: the speedup if every cast were free."""
        return self.bf16_step_seconds / (self.gemm_seconds + self.other_seconds)

    @property
    def gemm_speedup(self) -> float:
        """GEMMs and casts only (no non-GEMM share): what a GEMM benchmark with quantization measures."""
        return self.bf16_gemm_seconds / (self.gemm_seconds + self.cast_seconds)

    def dtype_share(self) -> dict[str, float]:
        """dtype -> share of the step's GEMM FLOPs that run in it."""
        flops: dict[str, float] = {}
        for g in (g for r in self.rows for g in r.gemms):
            flops[g.dtype] = flops.get(g.dtype, 0.0) + g.flops
        total = sum(flops.values()) or 1.0
        return {d: f / total for d, f in sorted(flops.items())}


def run_dtype(target: GemmTarget, gemm: str, gpu: GpuSpec, as_run: bool) -> str:
    """The dtype ``gemm`` of ``target`` runs in on ``gpu``: the kernel's (``gemm_dtype``), or with
    ``as_run`` and an emulated backend the emulation's (``emulated_gemm_dtype``)."""
    specs = dict(zip(ROLE_NAMES, target.plan.specs, strict=True))
    a, b = (specs[f"{gemm}.{op}"] for op in operands(gemm))
    backend = target.plan.backend(gemm)
    if as_run and (a is not None or b is not None) and backend in EMULATED_BACKENDS:
        return emulated_gemm_dtype(a, b, backend)
    return gemm_dtype(a, b, gpu)


def predict_target(
    target: GemmTarget, gpu: GpuSpec, params: SpeedParams = PARAMS, as_run: bool = False
) -> TargetRow:
    """The GEMMs and casts of one target on ``gpu`` (``as_run``: see ``predict``)."""
    specs = dict(zip(ROLE_NAMES, target.plan.specs, strict=True))
    rows, lowp = [], {}
    for gemm in GEMMS:
        dtype = run_dtype(target, gemm, gpu, as_run)
        lowp[gemm] = dtype not in ("bf16", "fp32")  # else fake-quantized: the cast writes bf16 values
        times, flops = target.repeats(gemm), target.flops(gemm)
        q = gemm_seconds(flops, gemm_io_bytes(target, gemm, dtype), dtype, gpu, params)
        hp = gemm_seconds(flops, gemm_io_bytes(target, gemm, "bf16"), "bf16", gpu, params)
        rows.append(GemmRow(gemm, dtype, times * flops, times * q, times * hp))
    contraction = {g: target.contraction(g) for g in GEMMS}
    repeats = {g: target.repeats(g) for g in GEMMS}
    costs = [
        tensor_cast(t, target.elems(t), specs, lowp, contraction, repeats) for t in TENSORS if target.elems(t)
    ]
    cast_bytes = sum(c.bytes for c in costs)
    kernels = sum(c.kernels for c in costs)
    seconds = (
        cast_bytes / (params.cast_bandwidth * gpu.hbm_tb_s * 1e12)
        + kernels * params.kernel_overhead_us * 1e-6
    )
    return TargetRow(target, tuple(rows), cast_bytes, seconds)


def predict(
    targets: list[GemmTarget], gpu: GpuSpec, params: SpeedParams = PARAMS, as_run: bool = False
) -> Prediction:
    """The step of ``targets`` (every GEMM target of a model, per GPU) on ``gpu``.

    Args:
        targets: the step's GEMM targets with their plans (``speed.workloads`` builds them from model
            dimensions, ``lbt-speed`` from a run config's resolved plan).
        gpu: the GPU (``speed.gpus.GPUS``).
        params: the efficiency parameters (default: the documented ``PARAMS``).
        as_run: what this package runs: GEMMs whose plan resolved to an emulated backend on that GPU
            (``LinearPlan.backends``) are fake-quantized and multiplied in bf16 or fp32
            (``model.emulated_gemm_dtype``) instead of at the kernel's rate (default: kernels).

    Returns:
        The prediction (per-target rows, the step's times, speedup and ceiling).

    Raises:
        ValueError: no targets.
    """
    if not targets:
        raise ValueError("predict: no GEMM targets (the model has no linear layer the plan covers)")
    return Prediction(gpu.name, tuple(predict_target(t, gpu, params, as_run) for t in targets), params)
