"""Forward+backward time of QuantLinear (emulate) against nn.Linear and torchao's emulated linears, on CPU.

    .venv/bin/python benchmarks/bench_linear.py            # 4096x4096 weight, 8192 tokens (slow on 2 cores)
    .venv/bin/python benchmarks/bench_linear.py --quick    # 1024x1024 weight, 2048 tokens

Prints a markdown table: ms per forward+backward and the ratio to plain fp32 nn.Linear. torchao rows are the
torchao backend's modules (``nn.torchao_modules.torchao_linear``) in torchao's emulated modes (Float8Linear
``emulate=True``, MXFP8 ``KernelPreference.EMULATED``: the only way either runs on a CPU). GPU: bench_gpu.py.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from low_bits_training.nn import LinearPlan, QuantLinear
from low_bits_training.nn.kernels import machine_line
from low_bits_training.nn.recipes import recipe_specs


def _time(mod: nn.Module, x: torch.Tensor, iters: int) -> float:
    """Median ms of one forward+backward (after a warm-up call)."""
    times = []
    for i in range(iters + 1):
        xi = x.detach().requires_grad_()
        t = time.perf_counter()
        mod(xi).sum().backward()
        if i:
            times.append((time.perf_counter() - t) * 1e3)
        mod.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2]


def _torchao(lin: nn.Linear, recipe: str) -> nn.Module:
    # The torchao backend's own module builder (nn.torchao_modules), in torchao's emulated mode.
    from low_bits_training.nn.torchao_modules import torchao_linear

    return torchao_linear(lin, LinearPlan.from_roles(recipe_specs(recipe)), emulated=True)


def candidates(lin: nn.Linear):
    """(name, recipe, module factory) rows; recipe names the row group in the table. Names are the plan
    table's backends: ``emulate`` (QuantLinear) and ``torchao_emulated`` (torchao's module, emulated mode)."""
    ours = lambda r: lambda: QuantLinear.from_linear(lin, LinearPlan.from_roles(recipe_specs(r)))  # noqa: E731
    theirs = lambda r: lambda: _torchao(lin, r)  # noqa: E731
    rows = [("nn.Linear fp32", "-", lambda: lin)]
    for recipe in ("fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_hp_wgrad", "mxfp8"):
        rows += [
            ("QuantLinear emulate", recipe, ours(recipe)),
            ("torchao torchao_emulated", recipe, theirs(recipe)),
        ]
    return rows + [("QuantLinear emulate", r, ours(r)) for r in ("deepseek_fp8", "mxfp4", "nvfp4", "int8")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1024x1024 weight, 2048 tokens")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--only", default="", help="comma-separated recipes to run (default: all)")
    args = p.parse_args()
    k = n = 1024 if args.quick else 4096
    m = 2048 if args.quick else 8192
    torch.manual_seed(0)
    lin = nn.Linear(k, n, bias=False)
    x = torch.randn(m, k)
    print(f"{machine_line()}\nweight {n}x{k}, {m} tokens, fp32, median of {args.iters}\n")
    print("| recipe | module | ms fwd+bwd | x fp32 |\n|---|---|---:|---:|")
    base = None
    for name, recipe, make in candidates(lin):
        if args.only and recipe not in args.only.split(",") and recipe != "-":
            continue
        ms = _time(make(), x, args.iters)
        base = base or ms
        print(f"| {recipe} | {name} | {ms:.1f} | {ms / base:.2f} |", flush=True)


if __name__ == "__main__":
    main()
