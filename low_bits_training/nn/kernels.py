"""Our own real fp8 GEMM (``torch._scaled_mm``), kept as a reference, and the emulation's bf16-input GEMM that
accumulates into fp32 (``mm_fp32_accumulate``); torchao's modules are the real kernels.

- Real kernels come from torchao: ``nn.torchao_recipes`` (which torchao module computes a plan) and the torchao
  backend (``plan.backends``, ``titan.targets.torchao_backend``).
- ``scaled_mm`` here: our cast + ``torch._scaled_mm`` (fp8 e4m3/e5m2, tensorwise or rowwise fp32 scales). It is
  a real fp8 GEMM that also runs on the CPU in torch 2.14.1, and the emulation is held to it bit for bit
  (tests/nn/test_scaled_mm.py): an outside check of our casts. It stays reachable from Python
  (``LinearPlan(backends=("real",) * 3)``) but is not offered in TOML: on a GPU torchao's modules are the
  faster path (fused casts, fp8 all-gather under FSDP2, compile support), and two hand-written real paths
  would be two things to keep right.
"""

from __future__ import annotations

import torch

from low_bits_training.formats import QuantSpec
from low_bits_training.upstream import cpu_has

from .cast import ShardGroups, scaled_values

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def unsupported_reason(a: QuantSpec | None, b: QuantSpec | None) -> str | None:
    """Why ``torch._scaled_mm`` cannot run a GEMM with operand specs ``a`` and ``b`` (None: it can)."""
    if a is None or b is None:
        return "an operand is high precision"
    for s in (a, b):
        if s.elem.name not in FP8_DTYPES:
            return f"format {s.elem.name} is not e4m3/e5m2"
        if s.scaling not in ("tensor", "axis") or s.tensor_scale:
            return f"scaling {s.scaling} is not tensorwise/rowwise"
        if s.rounding != "nearest" or not s.saturate:
            return "only round-to-nearest, saturating casts"
    if a.elem.name == b.elem.name == "e5m2":
        return "e5m2 x e5m2 is not supported"
    return None


def _fp8(t: torch.Tensor, spec: QuantSpec, transpose: bool, shards: ShardGroups):
    q, scale = scaled_values(t, spec, shards)  # q on the e4m3/e5m2 grid: the cast below is exact
    if transpose:
        q, scale = q.t(), scale.t()
    return q.to(FP8_DTYPES[spec.elem.name]), scale


def scaled_mm(
    a: torch.Tensor,
    sa: QuantSpec,
    a_t: bool,
    ga: ShardGroups,
    b: torch.Tensor,
    sb: QuantSpec,
    b_t: bool,
    gb: ShardGroups,
) -> torch.Tensor:
    """``A @ B`` in fp8 by ``torch._scaled_mm`` (fp32 accumulate and output).

    Args:
        a, b: natural 2-D operands; ``a_t`` / ``b_t`` transpose them after the cast.
        sa, sb: their specs (tensorwise or rowwise along the contraction dim, see ``unsupported_reason``).
        ga, gb: sharded dims under TP (global amax, see ``cast``).

    Returns:
        fp32 (P, Q) product.

    Raises:
        ValueError: the specs cannot run on ``_scaled_mm``.
    """
    reason = unsupported_reason(sa, sb)
    if reason:
        raise ValueError(f"backend 'real': {reason} ({sa} x {sb})")
    qa, scale_a = _fp8(a, sa, a_t, ga)  # (P, C), scale (P, 1) rowwise or (1, 1)
    qb, scale_b = _fp8(b, sb, b_t, gb)  # (C, Q), scale (1, Q) rowwise or (1, 1)
    if sa.scaling == sb.scaling == "tensor":
        scale_a, scale_b = scale_a.reshape(()), scale_b.reshape(())
    else:  # rowwise (a tensor scale broadcast to rows gives the same products); scales need unit stride
        scale_a = scale_a.expand(qa.shape[0], 1).reshape(-1).contiguous().unsqueeze(1)  # (P, 1)
        scale_b = scale_b.expand(1, qb.shape[1]).reshape(-1).contiguous().unsqueeze(0)  # (1, Q)
    qb = qb.t().contiguous().t()  # _scaled_mm wants B column-major
    return torch._scaled_mm(qa.contiguous(), qb, scale_a, scale_b, out_dtype=torch.float32)


@torch.library.custom_op("lbt::mm_fp32_accumulate", mutates_args=(), tags=(torch.Tag.flexible_layout,))
def mm_fp32_accumulate(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of fp32 operands whose every value is a bf16 number: exact products, fp32 accumulation,
    fp32 result (a bf16-input, fp32-output GEMM; the emulated GEMMs' fast path, ``nn.gemm``).

    On the CPU it runs oneDNN's fp32 GEMM with bf16 inputs (``torch.backends.mkldnn.matmul.fp32_precision
    = "bf16"``, set for this call only): on CPUs with AMX (``cpu_bf16_gemm``) a bf16 kernel, 3-5x faster
    than the fp32 GEMM, and exact here because rounding a bf16 number to bf16 changes nothing. Without AMX it
    depends on the CPU: on an AVX512-BF16 Xeon oneDNN ran its fp32 kernel; on an AMD EPYC with AVX512-BF16
    (2026-11-26) a bf16 kernel, 0.88 against 2.44 ms for the fp32 GEMM at 1024 x 256 x 768, 2 threads (the
    same exact products, summed in another order: last-bit differences in most elements). On CUDA a bf16 tensor-core GEMM with an fp32 result (``torch.mm(..., out_dtype=
    torch.float32)``, cuBLAS with fp32 compute; exact conversions, as the values are bf16 numbers) instead of
    the fp32 GEMM, which without TF32 (torch's default) runs on no tensor core. Other devices: the fp32 GEMM.
    An opaque op to torch.compile, so compiled and eager runs call the same kernel. The CPU setting is
    process-wide for the call's duration: an fp32 GEMM another thread ran in that window would take bf16
    inputs too (training runs its GEMMs on one thread per rank).
    """
    if a.device.type == "cuda":
        return tensor_core_mm(a, b)
    if a.device.type != "cpu":
        return torch.mm(a, b)
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        return torch.mm(a, b)
    finally:
        matmul.fp32_precision = before


def tensor_core_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``mm_fp32_accumulate`` on CUDA: bf16 operands (exact: their values are bf16 numbers), fp32 compute and
    result (``aten::mm.dtype``, registered for CUDA and meta only). On an H200 its fp32 sum errs up to ~7 units
    of 2**-24 x sum|ab| where an fp32 SGEMM errs ~0.5: the tensor cores do not round their sum to nearest
    (``speed.gpu_check.device.ACCUMULATE_BOUND``; not run on a GPU by the tests)."""
    return torch.mm(a.bfloat16(), b.bfloat16(), out_dtype=torch.float32)


@mm_fp32_accumulate.register_fake
def _mm_fp32_accumulate_shape(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]))


def cpu_bf16_gemm() -> str:
    """The bf16 GEMM units this CPU offers oneDNN, which set how fast the emulation runs against a bf16
    baseline: "amx" (AMX-BF16 tiles), "avx512_bf16" (bf16 dot products only) or "none".

    With AMX, bf16 GEMMs run 5-9x faster than fp32 ones and ``mm_fp32_accumulate`` uses them too: the
    baseline's GEMMs are cheap and the emulation's casts dominate its extra time. Without AMX (measured on an
    AVX512-BF16 Xeon, torch 2.14.1, 2 threads, 1024 x 256 x 768) oneDNN's bf16 GEMM took 2.4 ms against 1.4 ms
    for the fp32 one, and ``mm_fp32_accumulate`` ran the fp32 kernel: there the recipes whose GEMMs take fp32
    operands run faster than the bf16 baseline (docs/precision_plan.md, "Speed of the compiled emulation").
    """
    if cpu_has("amx") and torch.backends.mkldnn.is_available():
        return "amx"
    return "avx512_bf16" if cpu_has("avx512_bf16") else "none"


def machine_line() -> str:
    """One line naming what a CPU timing depends on: the CPU, its bf16 GEMM units, threads, torch."""
    import platform
    from pathlib import Path

    cpuinfo = Path("/proc/cpuinfo")
    names = [
        line.split(":", 1)[1].strip()
        for line in (cpuinfo.read_text().splitlines() if cpuinfo.is_file() else [])
        if line.startswith("model name")
    ]
    name = names[0] if names else platform.processor() or platform.machine()
    return f"{name}, bf16 GEMM units: {cpu_bf16_gemm()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
