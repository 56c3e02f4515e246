"""The speed model of a precision plan: every GEMM of a step, the dtype it runs in on a named GPU, its time,
the casts its operands need, and the step's speedup over bf16 with its Amdahl ceiling. Pure arithmetic.

For one target (a linear layer, an MoE expert weight, an attention product) with in_features K,
out_features N and M tokens per step, each of its three GEMMs (``nn.roles``) does ``2 M K N`` FLOPs and
takes ``flops / (efficiency * peak[dtype]) + io_bytes / bandwidth + overhead``. The step:

    T_bf16 = G_bf16 / (1 - s)          G: all GEMMs in bf16; s: the non-GEMM share of the bf16 step
    T      = G + C + s * T_bf16        G, C: the plan's GEMMs and casts
    speedup = T_bf16 / T               ceiling = T_bf16 / (G + s * T_bf16)   (casts free)

By default the model predicts what kernels that compute the plan would take (torchao's, Transformer
Engine's). ``predict(..., as_run=True)`` predicts what this package runs instead: a GEMM whose resolved
backend is an emulation (``plan.backends.gemm_backend``: ``emulate``, ``torchao_emulated``) multiplies
fake-quantized operands in bf16 or fp32 (``emulated_gemm_dtype``), whatever kernel the GPU has. See
docs/speed_model.md for the parameters and the published figures they are held against.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from low_bits_training.formats import QuantSpec
from low_bits_training.nn.gemm import exact_in_bf16
from low_bits_training.nn.roles import GEMMS, ROLE_NAMES, ROLES, LinearPlan
from low_bits_training.plan.resolve import EntryKind

from .casts import HIGH_BYTES, ONCHIP, elem_bytes, tensor_cast
from .gpus import GpuSpec
from .params import SpeedParams

ELEM_DTYPE: dict[str, str] = {
    "e4m3": "fp8",
    "e5m2": "fp8",
    "e2m3": "fp6",
    "e3m2": "fp6",
    "e2m1": "fp4",
    "int8": "int8",
}
"""Element formats that some GPU multiplies natively, and the dtype class of their GEMM."""
BLOCK_FAMILIES: dict[tuple[int, str], str] = {
    (32, "e8m0"): "mx32",
    (16, "ue4m3"): "nv16",
    (128, "fp32"): "block128",
}
"""(block or tile side, scale format) -> the family of scaled GEMM that consumes it (``gpus.SCALED_FAMILIES``)."""
OPERAND_GEMM_OUTPUT = {"forward": "grad_output", "dgrad": "input", "wgrad": "weight"}
EMULATED_BACKENDS = ("emulate", "torchao_emulated")
"""GEMM backends (``plan.backends.gemm_backend``) that emulate the plan instead of running a kernel for it."""
"""The tensor each GEMM writes: y has grad_output's shape, dx input's, dW weight's."""


@dataclass(frozen=True)
class GemmTarget:
    """One plan target as the speed model sees it (per GPU, per step)."""

    fqn: str
    in_features: int
    """K."""
    out_features: int
    """N (the local shard under tensor parallelism)."""
    tokens: int
    """M: rows per instance per step (for expert weights: every routed token, summed over the experts)."""
    plan: LinearPlan = field(default_factory=LinearPlan)
    kind: EntryKind = "linear"
    count: int = 1
    """Independent instances (batch x heads for an attention product)."""
    groups: int = 1
    """Weights stacked in one grouped GEMM (the experts of an MoE layer): multiplies the weight's bytes."""
    causal: float = 1.0
    """Fraction of the product computed (0.5: causal attention skips the masked half)."""
    recompute: float = 0.0
    """Extra forward passes per step (activation checkpointing; 1.0 for flash attention's Q K^T)."""
    weight_share: float = 1.0
    """Share of the weight this GPU casts (1/dp where FSDP all-gathers an already-cast fp8 weight)."""

    def dims(self, tensor: str) -> tuple[int, int]:
        """(rows, cols) of one instance of ``input`` (M, K), ``weight`` (N, K) or ``grad_output`` (M, N)."""
        m, n, k = self.tokens, self.out_features, self.in_features
        return {"input": (m, k), "weight": (n, k), "grad_output": (m, n)}[tensor]

    def elems(self, tensor: str) -> float:
        """Elements of ``tensor`` per step on this GPU (0 for an attention operand kept on chip)."""
        if ONCHIP.get(self.kind) == tensor:
            return 0.0
        rows, cols = self.dims(tensor)
        if tensor == "weight":
            return rows * cols * self.count * self.groups * self.weight_share
        return rows * cols * self.count

    def contraction(self, gemm: str) -> int:
        """The contraction length of ``gemm``: K (forward), N (dgrad), M (wgrad)."""
        return {"forward": self.in_features, "dgrad": self.out_features, "wgrad": self.tokens}[gemm]

    def flops(self, gemm: str) -> float:
        """FLOPs of one run of ``gemm`` per step (all instances)."""
        return 2.0 * self.tokens * self.in_features * self.out_features * self.count * self.causal

    def repeats(self, gemm: str) -> float:
        """Runs of ``gemm`` per step."""
        return 1.0 + self.recompute if gemm == "forward" else 1.0


def scale_family(spec: QuantSpec) -> str:
    """Which scaled GEMM consumes ``spec``'s scales: "scaled" (one per tensor or row), "mx32", "nv16",
    "block128" (blocks or 2-D tiles of that side), or "other" (no kernel has it)."""
    if spec.scaling in ("none", "tensor", "axis"):
        return "scaled"
    return BLOCK_FAMILIES.get((spec.block_size, spec.scale_format), "other")


def gemm_dtype(a: QuantSpec | None, b: QuantSpec | None, gpu: GpuSpec) -> str:
    """The dtype a GEMM with operand specs ``a``, ``b`` runs in on ``gpu``: a low-precision dtype where the
    GPU has a kernel for both operands' formats and scales, else "bf16" (the operands are fake-quantized).

    Mixed MX element widths (fp8 x fp6 x fp4 at 1x32 e8m0) run at the fp8 rate (Blackwell's MXF8F6F4);
    per-tensor or per-row scales ride along DeepSeek's 128-blocks (they are such blocks with equal scales).
    """
    if a is None or b is None:
        return "bf16"
    ca, cb = ELEM_DTYPE.get(a.format), ELEM_DTYPE.get(b.format)
    fams = {scale_family(a), scale_family(b)}
    family = "block128" if fams == {"scaled", "block128"} else next(iter(fams))
    if ca is None or cb is None or len(fams) > 1 and family != "block128":
        return "bf16"
    if ca == cb:
        dtype = ca
    elif {ca, cb} <= {"fp8", "fp6", "fp4"} and family == "mx32":
        dtype = "fp8"
    else:
        return "bf16"
    return dtype if gpu.runs(ca, family) and gpu.runs(cb, family) else "bf16"


def emulated_gemm_dtype(a: QuantSpec | None, b: QuantSpec | None, backend: str) -> str:
    """The dtype an emulated GEMM multiplies in on a GPU (bf16 mixed precision).

    Ours (``emulate``, ``nn.gemm``): bf16 where both operands' GEMM parts are bf16 numbers
    (``nn.gemm.exact_in_bf16``: mxfp8, nvfp4, fp8 per tensor or row), else fp32 (deepseek_fp8's
    exact fp32 block scales): CUDA cores, since torch leaves TF32 off. torchao's emulated mode
    (``torchao_emulated``) dequantizes to fp32 and multiplies there (torchao/float8/float8_ops.py).
    """
    if backend == "torchao_emulated":
        return "fp32"
    exact = exact_in_bf16(a, torch.bfloat16) and exact_in_bf16(b, torch.bfloat16)
    return "bf16" if exact else "fp32"


def operands(gemm: str) -> tuple[str, str]:
    """The two operand tensors of ``gemm`` (``nn.roles.ROLES`` order)."""
    return tuple(r.operand for r in ROLES if r.gemm == gemm)


def gemm_io_bytes(target: GemmTarget, gemm: str, dtype: str) -> float:
    """HBM bytes one run of ``gemm`` reads (its two operands) and writes (its bf16 output; an fp32 GEMM
    reads fp32 operands)."""
    specs = dict(zip(ROLE_NAMES, target.plan.specs, strict=True))
    total = target.elems(OPERAND_GEMM_OUTPUT[gemm]) * HIGH_BYTES
    wide = {"bf16": HIGH_BYTES, "fp32": 4.0}
    for role in (r for r in ROLES if r.gemm == gemm):
        spec = specs[role.name]
        width = wide.get(dtype, HIGH_BYTES) if dtype in wide or spec is None else elem_bytes(spec)
        total += target.elems(role.operand) * width
    return total


def gemm_seconds(flops: float, io_bytes: float, dtype: str, gpu: GpuSpec, params: SpeedParams) -> float:
    """Time of one GEMM: its multiply-adds at the efficiency-scaled peak, its operand and output bytes at
    the HBM bandwidth, and one kernel overhead."""
    efficiency = params.gemm_efficiency * (params.fp4_efficiency if dtype == "fp4" else 1.0)
    compute = flops / (efficiency * gpu.peak(dtype))
    return compute + io_bytes / (gpu.hbm_tb_s * 1e12) + params.kernel_overhead_us * 1e-6


__all__ = [
    "EMULATED_BACKENDS",
    "GEMMS",
    "GemmTarget",
    "emulated_gemm_dtype",
    "gemm_dtype",
    "gemm_io_bytes",
    "gemm_seconds",
    "scale_family",
    "tensor_cast",
]
