"""Forward+backward of Llama-3-8B-shaped linears on one GPU: bf16, our emulation and torchao's kernels per recipe.

    python benchmarks/bench_gpu.py                                  # 4 shapes x recipes, 16384 tokens, eager+compiled
    python benchmarks/bench_gpu.py --tokens 8192 --recipes fp8_rowwise,mxfp8 --modes compiled
    python benchmarks/bench_gpu.py --train                          # + a few training steps of Llama 3.2 1B

First the GPU check's backend, CUDA-graph, tensor-core and NaN-guard items (``CHECKS``, from the one home of the
GPU checks, ``low_bits_training/speed/gpu_check``; ``--no-checks`` skips them; a failed one makes the exit code 1).
Compiled rows are compiled through ``gpu_check.compiling.compile_variants``: 5 recipes x 4 shapes of one module
class are past dynamo's recompile limit, and without it the later "compiled" rows would silently run eager.

One line and exit code 2 on a machine without CUDA. torchao or torchtitan missing (e.g. a plain torch 2.11 box):
the torchao rows say "unavailable" and the bf16 / emulation rows still run; ``--train`` needs the full stack.
The "auto" column is what ``[quantize] backend = "auto"`` runs on this GPU (``plan.backends.gemm_backend``).
Prints a markdown table: median ms of forward+backward (bf16 input, CUDA events) and the ratio to bf16 nn.Linear.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHAPES = {  # Llama 3 8B (dim 4096, 32 heads, 8 KV heads of 128, FFN 14336): (in_features, out_features)
    "attention.wqkv": (4096, 6144),
    "attention.wo": (4096, 4096),
    "feed_forward.w1": (4096, 14336),
    "feed_forward.w2": (14336, 4096),
}
RECIPES = ("fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_hp_wgrad", "mxfp8", "nvfp4")
CHECKS = ("backends per recipe", "CUDA graph replay", "fp32-accumulate GEMM", "NaN guard")
"""The GPU check's items run first (``scripts/gpu_check.sh --items``)."""


def refuse_without_cuda() -> None:
    if not torch.cuda.is_available():
        print(
            "bench_gpu: no CUDA device visible; this benchmark needs a GPU (CPU: benchmarks/bench_linear.py)"
        )
        sys.exit(2)


def time_fwd_bwd(module: torch.nn.Module, x: torch.Tensor, iters: int, warmup: int = 3) -> float:
    """Median ms of ``module(x).backward(dy)`` over ``iters`` runs (CUDA events, after ``warmup`` runs)."""
    dy = torch.randn(x.shape[0], module.out_features, device=x.device, dtype=x.dtype)
    times = []
    for i in range(warmup + iters):
        xi = x.detach().requires_grad_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        module(xi).backward(dy)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
        module.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2]


def plans(recipe: str, k: int, n: int, tokens: int):
    """(plan as backend "auto" resolves it on this GPU, the same specs for our emulation)."""
    from low_bits_training.config.quantize import QuantizeConfig
    from low_bits_training.nn import LinearPlan
    from low_bits_training.nn.hardware import detect_hardware
    from low_bits_training.plan.resolve import LayerShape, resolve_plan

    auto = resolve_plan(
        QuantizeConfig(recipe=recipe, skip=[]), {"w": LayerShape(k, n, tokens)}, detect_hardware()
    )["w"]
    return auto, LinearPlan(auto.specs)


def torchao_row(lin: torch.nn.Linear, plan) -> tuple[str, torch.nn.Module | None]:
    """(label, module) for torchao's module of ``plan``, or (why not, None)."""
    from low_bits_training.nn.hardware import detect_hardware
    from low_bits_training.nn.torchao_modules import torchao_linear
    from low_bits_training.nn.torchao_recipes import torchao_recipe
    from low_bits_training.plan.backends import torchao_kernel_refusal

    recipe = torchao_recipe(plan)
    if recipe is None:
        return "torchao: no module computes this plan", None
    why = torchao_kernel_refusal(recipe, detect_hardware())
    if why:
        return f"torchao {recipe.module}: unavailable ({why})", None
    return f"torchao {recipe.module} ({recipe.label})", torchao_linear(lin, plan, emulated=False)


def candidates(lin: torch.nn.Linear, recipe: str, tokens: int):
    """(label, "auto" backend, module or None) rows of one recipe on one shape."""
    from low_bits_training.nn import QuantLinear
    from low_bits_training.plan.backends import gemm_backend

    auto, ours = plans(recipe, lin.in_features, lin.out_features, tokens)
    picks = "/".join(dict.fromkeys(gemm_backend(auto, g) for g in ("forward", "dgrad", "wgrad")))
    rows = [("QuantLinear (emulate)", picks, QuantLinear.from_linear(lin, ours))]
    label, module = torchao_row(lin, ours)
    return [*rows, (label, picks, module)]


def run_shapes(args) -> list[dict]:
    results = []
    for name, (k, n) in SHAPES.items():
        lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(args.tokens, k, device="cuda", dtype=torch.bfloat16)
        rows = [("bf16", "nn.Linear", "high", lin)]
        rows += [
            (r, label, picks, m) for r in args.recipes for label, picks, m in candidates(lin, r, args.tokens)
        ]
        for recipe, label, picks, module in rows:
            row = {"shape": f"{name} {k}x{n}", "recipe": recipe, "module": label, "auto": picks}
            for mode in args.modes:
                row[mode] = measure(module, x, args.iters, mode)
            results.append(row)
            print_row(row, results, args.modes)
    return results


def measure(module, x, iters: int, mode: str) -> float | str | None:
    if module is None:
        return None
    try:
        from low_bits_training.speed.gpu_check.compiling import compile_variants

        m = compile_variants([module])[0] if mode == "compiled" else module  # the limit counts every variant
        return time_fwd_bwd(m, x, iters)
    except Exception as e:  # reported in the table (and the exit code), not hidden
        return f"failed: {str(e).splitlines()[0][:80]}"


def print_row(row: dict, results: list[dict], modes: list[str]) -> None:
    base = next(r for r in results if r["shape"] == row["shape"] and r["recipe"] == "bf16")
    cells = []
    for mode in modes:
        v, b = row[mode], base[mode]
        ok = isinstance(v, float) and isinstance(b, float)
        cells += [f"{v:.3f}" if ok else str(v or "-"), f"{v / b:.2f}" if ok else "-"]
    print(
        "| " + " | ".join([row["shape"], row["recipe"], row["module"], row["auto"], *cells]) + " |",
        flush=True,
    )


def train_rows(args) -> list[dict]:
    """A few steps of Llama 3.2 1B on the built-in corpus (1 GPU, compiled) per recipe and backend."""
    rows = []
    for recipe in ["bf16", *args.recipes]:
        for backend in ["auto"] if recipe == "bf16" else ["emulate", "auto"]:
            tps = train_once(recipe, backend, args.train_steps)
            rows.append({"recipe": recipe, "backend": backend, "tokens/s": tps})
            print(
                f"| train 1B | {recipe} | backend {backend} | median tok/s after step 3: {tps} |", flush=True
            )
    return rows


def train_once(recipe: str, backend: str, steps: int) -> float | str:
    from low_bits_training.titan.runtime.metrics import read_metrics

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--rdzv_backend=c10d",
            "--rdzv_endpoint=localhost:0", "-m", "low_bits_training.titan.launch.worker",
            "--config-file", str(REPO / "train_configs" / "llama3_1b.toml"), "--dump_folder", tmp,
            "--training.steps", str(steps), "--training.seq_len", "4096", "--training.local_batch_size", "2",
            "--dataloader.dataset", "lbt_markov", "--dataloader.dataset_path", "./assets/lbt_markov",
            "--hf_assets_path", "./assets/lbt_markov", "--checkpoint.no-enable", "--metrics.log_freq", "1",
            "--metrics.no-enable-tensorboard", "--quantize.recipe", recipe, "--quantize.backend", backend,
        ]  # fmt: skip
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        if p.returncode != 0:
            return f"failed ({p.returncode}): {p.stderr.strip().splitlines()[-1][:100] if p.stderr.strip() else ''}"
        tps = sorted(
            r["throughput(tps)"] for r in read_metrics(tmp) if r["step"] > 3 and "throughput(tps)" in r
        )
        return round(tps[len(tps) // 2], 1) if tps else "no steps after step 3"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per GEMM (M); 8192 or 16384")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe names")
    p.add_argument("--modes", default="eager,compiled", help="eager, compiled or both")
    p.add_argument("--train", action="store_true", help="also train Llama 3.2 1B a few steps per recipe")
    p.add_argument("--train-steps", type=int, default=12)
    p.add_argument("--json", default="", help="also write the results here")
    p.add_argument("--no-checks", action="store_true", help="skip the GPU check's items run first (CHECKS)")
    args = p.parse_args(argv)
    refuse_without_cuda()
    args.recipes, args.modes = args.recipes.split(","), args.modes.split(",")
    sys.path.insert(0, str(REPO))
    checks = 0
    if not args.no_checks:  # issue 29's checks first: a timing on a GPU that fails them means little
        checks = run_checks()
        print()
    name, cap = torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0)
    print(
        f"{name} (SM{cap[0]}{cap[1]}), torch {torch.__version__}, {args.tokens} tokens, bf16, median of {args.iters}"
    )
    print(f"torchao: {_version('torchao')}, torchtitan: {_version('torchtitan')}\n")
    modes = [c for m in args.modes for c in (f"ms {m}", f"x bf16 {m}")]
    print("| shape | recipe | module | auto | " + " | ".join(modes) + " |\n|" + "---|" * (4 + len(modes)))
    results = {"linears": run_shapes(args)}
    if args.train:
        results["train"] = train_rows(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    failed = [
        r for r in results["linears"] if any(str(r.get(m, "")).startswith("failed") for m in args.modes)
    ]
    return 1 if failed or checks else 0


def run_checks() -> int:
    """The GPU check's ``CHECKS`` items (levels 1-2) on this GPU; their exit code."""
    from low_bits_training.speed.gpu_check import runner

    with tempfile.TemporaryDirectory() as out:
        return runner.main(["--levels", "1,2", "--items", ",".join(CHECKS), "--out", out])


def _version(pkg: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "not installed (its rows: unavailable)"


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench-gpu-inductor-"))
    sys.exit(main())
