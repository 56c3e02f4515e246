"""Forward+backward time of QuantLinear (emulate) against nn.Linear and torchao's emulated linears, on CPU.

    .venv/bin/python benchmarks/bench_linear.py            # 4096x4096 weight, 8192 tokens (slow on 2 cores)
    .venv/bin/python benchmarks/bench_linear.py --quick    # 1024x1024 weight, 2048 tokens

Prints a markdown table: ms per forward+backward and the ratio to plain fp32 nn.Linear. torchao rows:
``Float8Linear`` with ``emulate=True`` (tensorwise and rowwise configs) and ``MXFP8Linear`` with
``KernelPreference.EMULATED`` (the only way either runs on a CPU).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from low_bits_training.config.recipes import recipe_specs
from low_bits_training.nn import LinearPlan, QuantLinear


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


def _torchao_float8(lin: nn.Linear, recipe: str) -> nn.Module:
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    cfg = Float8LinearConfig.from_recipe_name(recipe)
    cfg = Float8LinearConfig(**{**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}, "emulate": True})
    return Float8Linear.from_float(lin, config=cfg)


def _torchao_mxfp8(lin: nn.Linear) -> nn.Module:
    from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    mod = MXFP8Linear(
        lin.in_features, lin.out_features, bias=False, kernel_preference=KernelPreference.EMULATED
    )
    mod.weight = lin.weight
    return mod


def candidates(lin: nn.Linear):
    """(name, recipe, module factory) rows; recipe names the row group in the table."""
    ours = lambda r: lambda: QuantLinear.from_linear(lin, LinearPlan.from_roles(recipe_specs(r)))  # noqa: E731
    return [
        ("nn.Linear fp32", "-", lambda: lin),
        ("QuantLinear emulate", "fp8_tensorwise", ours("fp8_tensorwise")),
        ("torchao Float8Linear emulate", "fp8_tensorwise", lambda: _torchao_float8(lin, "tensorwise")),
        ("QuantLinear emulate", "fp8_rowwise", ours("fp8_rowwise")),
        ("torchao Float8Linear emulate", "fp8_rowwise", lambda: _torchao_float8(lin, "rowwise")),
        ("QuantLinear emulate", "fp8_rowwise_hp_wgrad", ours("fp8_rowwise_hp_wgrad")),
        (
            "torchao Float8Linear emulate",
            "fp8_rowwise_hp_wgrad",
            lambda: _torchao_float8(lin, "rowwise_with_gw_hp"),
        ),
        ("QuantLinear emulate", "mxfp8", ours("mxfp8")),
        ("torchao MXFP8Linear emulated", "mxfp8", lambda: _torchao_mxfp8(lin)),
        ("QuantLinear emulate", "deepseek_fp8", ours("deepseek_fp8")),
        ("QuantLinear emulate", "mxfp4", ours("mxfp4")),
        ("QuantLinear emulate", "nvfp4", ours("nvfp4")),
        ("QuantLinear emulate", "int8", ours("int8")),
    ]


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
    print(f"weight {n}x{k}, {m} tokens, fp32, {torch.get_num_threads()} threads, median of {args.iters}\n")
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
