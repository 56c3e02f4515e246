"""How far each GEMM of bf16-valued operands lands from the exact product: the numbers behind the GPU check's
"fp32-accumulate GEMM vs float64" bound (``speed.gpu_check.device.ACCUMULATE_BOUND``).

For 512 x K x 512 products of bf16 numbers it prints, per GEMM and K, the largest error per element in units of
u x sum_k |a_k b_k| (u = 2**-24; the CPU's fp32 GEMM: 0.26-2.2 here), and its mean signed value (a bias). CUDA rows run where torch sees a GPU; the CPU rows always.

    python benchmarks/gemm_accumulation.py [--k 256 2048 8192] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from low_bits_training.nn.kernels import mm_fp32_accumulate  # noqa: E402
from low_bits_training.speed.gpu_check.device import error_units  # noqa: E402


def _cuda_gemms() -> dict[str, Callable]:
    m = torch.backends.cuda.matmul

    def bf16_fp32(reduced: bool) -> Callable:
        def run(a, b):
            before, m.allow_bf16_reduced_precision_reduction = (
                m.allow_bf16_reduced_precision_reduction,
                reduced,
            )
            try:
                return torch.mm(a.bfloat16(), b.bfloat16(), out_dtype=torch.float32)
            finally:
                m.allow_bf16_reduced_precision_reduction = before

        return run

    def tf32(a, b):
        before, m.allow_tf32 = m.allow_tf32, True
        try:
            return torch.mm(a, b)
        finally:
            m.allow_tf32 = before

    return {
        "cuda: bf16 tensor cores, fp32 result (mm_fp32_accumulate)": bf16_fp32(True),
        "cuda: the same, reduced-precision reduction off": bf16_fp32(False),
        "cuda: fp32 SGEMM": torch.mm,
        "cuda: TF32": tf32,
        "cuda: bf16 result": lambda a, b: torch.mm(a.bfloat16(), b.bfloat16()),
    }


def _cpu_gemms() -> dict[str, Callable]:
    return {
        "cpu: mm_fp32_accumulate": mm_fp32_accumulate,
        "cpu: fp32 GEMM": torch.mm,
        "cpu: bf16 result": lambda a, b: torch.mm(a.bfloat16(), b.bfloat16()),
    }


def measure(k: int, device: str, gemm: Callable, seed: int = 0) -> dict[str, float]:
    """Max and mean signed error of ``gemm`` on one 512 x k x 512 product, in units of u x sum|ab|."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(512, k, generator=g).bfloat16().float()
    b = torch.randn(k, 512, generator=g).bfloat16().float()
    err = error_units(gemm(a.to(device), b.to(device)), a, b)
    return {"max": err.abs().max().item(), "mean_signed": err.mean().item()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--k", type=int, nargs="+", default=[256, 2048, 8192])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    gemms = [("cpu", _cpu_gemms())] + ([("cuda", _cuda_gemms())] if torch.cuda.is_available() else [])
    where = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    print(f"torch {torch.__version__}, {where}; error per element in units of 2**-24 x sum_k |a_k b_k|")
    print("| GEMM | " + " | ".join(f"K = {k}: max (mean signed)" for k in args.k) + " |")
    print("|---|" + "---|" * len(args.k))
    rows = {}
    for device, fns in gemms:
        for name, fn in fns.items():
            rows[name] = {k: measure(k, device, fn) for k in args.k}
            cells = [f"{r['max']:.3g} ({r['mean_signed']:+.2g})" for r in rows[name].values()]
            print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
