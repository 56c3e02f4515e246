"""Throughput of ``fake_quantize`` per format and scaling on CPU, next to a plain copy and torchao.

For every case one run measures, on the same fp32 tensor (default 4096 x 4096 = 64 MiB, beyond the caches):
our ``fake_quantize`` eager and under ``torch.compile``, torchao's equivalent emulation (MX ``to_mx`` +
``to_dtype``; float8 ``tensor_to_scale`` + ``to_fp8_saturated`` + divide; NVFP4 ``to_nvfp4`` + ``dequantize``)
eager and compiled, and ``x.clone()`` (the memory floor: read + write of the same bytes). GB/s counts input
bytes. Timings are the minimum over repetitions (robust to other load on a shared machine).

    OMP_NUM_THREADS=2 python benchmarks/bench_formats.py [--quick] [--size 4096] [--reps 3]
        [--dtype bfloat16] [--only e5m2 ...]

``--dtype bfloat16`` times the casts of bf16 tensors (training's activations and gradients: under
torch.compile a kernel reading bf16 steps 32 elements at a time, which changes which casts vectorize).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench-formats-inductor-"))

import torch  # noqa: E402

from low_bits_training.formats import QuantSpec, fake_quantize  # noqa: E402
from low_bits_training.nn.kernels import machine_line  # noqa: E402


def _ao_float8(dtype: torch.dtype, rowwise: bool) -> Callable[[torch.Tensor], torch.Tensor]:
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    gran = ScalingGranularity.AXISWISE if rowwise else ScalingGranularity.TENSORWISE

    def run(x: torch.Tensor) -> torch.Tensor:
        scale = tensor_to_scale(x, dtype, scaling_granularity=gran, axiswise_dim=-1 if rowwise else None)
        return to_fp8_saturated(x * scale, dtype).to(torch.float32) / scale

    return run


def _ao_mx(elem: str, mode: str) -> Callable[[torch.Tensor], torch.Tensor]:
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2, "e2m3": "fp6_e2m3", "e3m2": "fp6_e3m2",
             "e2m1": torch.float4_e2m1fn_x2}[elem]  # fmt: skip
    smode = getattr(ScaleCalculationMode, mode.upper())

    def run(x: torch.Tensor) -> torch.Tensor:
        scale, data = to_mx(x, dtype, 32, smode)
        return to_dtype(data, scale, dtype, 32, x.dtype)

    return run


def _ao_nvfp4(x: torch.Tensor) -> torch.Tensor:
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale

    ts = per_tensor_amax_to_scale(x.abs().amax())
    return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=ts).dequantize(x.dtype)


def cases(quick: bool) -> list[tuple[str, QuantSpec, Callable | None]]:
    """(label, our spec, torchao's equivalent or None)."""
    full = [
        ("fp8 e4m3 tensorwise", QuantSpec.fp8_tensorwise(), _ao_float8(torch.float8_e4m3fn, False)),
        ("fp8 e4m3 rowwise", QuantSpec.fp8_rowwise(), _ao_float8(torch.float8_e4m3fn, True)),
        ("fp8 e5m2 tensorwise", QuantSpec.fp8_tensorwise("e5m2"), _ao_float8(torch.float8_e5m2, False)),
        ("mxfp8 e4m3 floor", QuantSpec.mxfp8(scale_rounding="floor"), _ao_mx("e4m3", "floor")),
        ("mxfp8 e4m3 rceil", QuantSpec.mxfp8(), _ao_mx("e4m3", "rceil")),  # recipe mxfp8
        ("mxfp8 e5m2 floor", QuantSpec.mxfp8("e5m2", "floor"), _ao_mx("e5m2", "floor")),
        ("mxfp6 e2m3 floor", QuantSpec.mxfp6(), _ao_mx("e2m3", "floor")),
        ("mxfp6 e3m2 floor", QuantSpec.mxfp6("e3m2"), _ao_mx("e3m2", "floor")),
        ("mxfp4 e2m1 floor", QuantSpec.mxfp4(), _ao_mx("e2m1", "floor")),
        ("nvfp4 (1x16 ue4m3 + fp32)", QuantSpec.nvfp4(), _ao_nvfp4),
        ("e4m3 1x128 (DeepSeek act)", QuantSpec.deepseek_act(), None),
        ("e4m3 128x128 (DeepSeek wt)", QuantSpec.deepseek_weight(), None),
        ("int8 rowwise", QuantSpec.int8_rowwise(), None),
        ("e4m3 tensorwise, stochastic", QuantSpec("e4m3", rounding="stochastic"), None),
        ("bf16 (no scaling)", QuantSpec("bf16", "none"), None),
    ]
    keep = {"fp8 e4m3 tensorwise", "mxfp8 e4m3 floor", "mxfp4 e2m1 floor", "nvfp4 (1x16 ue4m3 + fp32)"}
    return [c for c in full if c[0] in keep] if quick else full


def timeit(fn: Callable[[], object], reps: int) -> float:
    """Minimum wall time of ``fn`` over ``reps`` runs after one warm-up (which includes any compile)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(x: torch.Tensor, fn: Callable[[torch.Tensor], torch.Tensor], reps: int) -> tuple[float, float]:
    """(eager seconds, compiled seconds) for one function of x.

    Every case's lambda shares one code object, and dynamo guards each spec separately: past
    ``recompile_limit`` (8 by default) it would silently run eager, so ``main`` raises the limit.
    """
    eager = timeit(lambda: fn(x), reps)
    compiled = torch.compile(fn, dynamic=False)
    return eager, timeit(lambda: compiled(x), reps)


def _cell(t: float | None, nbytes: int, floor: float) -> str:
    if t is None:
        return "-"
    return f"{t * 1e3:.1f} ms / {nbytes / t / 1e9:.2f} GB/s ({t / floor:.1f}x)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1024 x 4096 and four cases")
    ap.add_argument("--size", type=int, default=4096, help="rows and columns of the fp32 input")
    ap.add_argument("--reps", type=int, default=3, help="timed runs per cell (minimum taken)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="input dtype")
    ap.add_argument("--only", nargs="*", default=None, help="cases whose label contains one of these")
    args = ap.parse_args()
    torch._dynamo.config.recompile_limit = 64  # one recompile per spec, see measure()
    rows = 1024 if args.quick else args.size
    x = torch.randn(rows, args.size, generator=torch.Generator().manual_seed(0)).to(
        getattr(torch, args.dtype)
    )
    nbytes = x.numel() * x.element_size()
    floor = timeit(lambda: x.clone(), args.reps * 2)
    print(f"load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(machine_line())
    print(f"input {tuple(x.shape)} {args.dtype} "
          f"({nbytes / 2**20:.0f} MiB); clone (memory floor) {floor * 1e3:.1f} ms = {nbytes / floor / 1e9:.2f} GB/s")  # fmt: skip
    print("\ncells: time / input GB/s (x the clone time)\n")
    print("| case | spec | ours eager | ours compiled | torchao eager | torchao compiled |")
    print("|---|---|---|---|---|---|")
    chosen = [c for c in cases(args.quick) if args.only is None or any(o in c[0] for o in args.only)]
    for label, spec, ao in chosen:
        ours = measure(x, lambda t, s=spec: fake_quantize(t, s), args.reps)
        theirs = measure(x, ao, args.reps) if ao is not None else (None, None)
        cells = [_cell(t, nbytes, floor) for t in (*ours, *theirs)]
        print(f"| {label} | `{spec.short()}` | " + " | ".join(cells) + " |", flush=True)
    print(f"\nload average at end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
