"""Optimizer-state bytes per parameter, peak memory of a step and step time, per optimizer option.

Run: .venv/bin/python benchmarks/bench_optim.py [--quick]
Each option runs in its own process (fresh peak-RSS counter, own inductor cache for torchao's compiled
steps) on a stack of square linear weights: 12 x 2048^2 = 50.3M parameters (--quick: 4 x 1024^2 = 4.2M).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

OPTIONS: dict[str, tuple[str, dict]] = {
    "torch AdamW fp32 (foreach)": ("AdamW", {}),
    "LowBitAdamW bf16/bf16": ("LowBitAdamW", {"exp_avg": "bf16", "exp_avg_sq": "bf16"}),
    "LowBitAdamW int8/e4m3 block128": ("LowBitAdamW", {}),
    "LowBitAdamW int4/e2m1 block128": (
        "LowBitAdamW",
        {"exp_avg": "int4_block128", "exp_avg_sq": "e2m1_block128"},
    ),
    "LowBitAdamW int4/e2m1 block32 e8m0": (
        "LowBitAdamW",
        {"exp_avg": "int4_block32_e8m0", "exp_avg_sq": "e2m1_block32_e8m0"},
    ),
    "LowBitAdamW int8/e4m3 + bf16 master Kahan": (
        "LowBitAdamW",
        {"master_weights": "bf16", "master_rounding": "kahan"},
    ),
    "torchao AdamW8bit": ("AdamW8bit", {}),
    "torchao AdamW4bit": ("AdamW4bit", {}),
    "torchao AdamWFp8": ("AdamWFp8", {}),
}


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024


def _state_bytes(opt) -> int:
    """Bytes of every optimizer-state tensor except the step counters (tensor subclasses: their parts)."""
    import torch

    def nbytes(t) -> int:
        if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:
            names, _ = t.__tensor_flatten__()
            return sum(nbytes(getattr(t, n)) for n in names)
        return t.untyped_storage().nbytes() if t.dim() else 0

    return sum(
        nbytes(v) for st in opt.state.values() for k, v in st.items() if torch.is_tensor(v) and k != "step"
    )


def _build(name: str, extra: dict, params):
    import torch

    kw = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
    if name == "AdamW":
        return torch.optim.AdamW(params, **kw)
    if name.startswith("LowBit"):
        from low_bits_training.optim import OPTIMIZERS

        return OPTIMIZERS[name](params, **kw, **extra)
    import torchao.optim

    return getattr(torchao.optim, name)(params, **kw)


def child(label: str, quick: bool, steps: int) -> dict:
    """Measure one option in this process."""
    import torch

    torch.manual_seed(0)
    n, d = (4, 1024) if quick else (12, 2048)
    params = [torch.randn(d, d).requires_grad_() for _ in range(n)]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    numel = sum(p.numel() for p in params)
    name, extra = OPTIONS[label]
    opt = _build(name, extra, params)
    base = _rss_mib()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "label": label,
        "params": numel,
        "bytes_per_param": _state_bytes(opt) / numel,
        "peak_mib": peak - base,
        "first_s": times[0],
        "step_s": statistics.median(times[1:]),
    }


def run_all(quick: bool, steps: int) -> list[dict]:
    out = []
    for label in OPTIONS:
        with tempfile.TemporaryDirectory(prefix="lbt-bench-inductor-") as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            cmd = [
                sys.executable,
                __file__,
                "--child",
                label,
                "--steps",
                str(steps),
                *(["--quick"] if quick else []),
            ]
            p = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if p.returncode:
            print(f"{label} failed:\n{p.stderr[-2000:]}", file=sys.stderr)
            continue
        out.append(json.loads(p.stdout.strip().splitlines()[-1]))
    return out


def table(rows: list[dict]) -> str:
    ref = next((r for r in rows if r["label"].startswith("torch AdamW")), None)
    lines = [
        "| optimizer | state bytes/param | peak RSS above params+grads (MiB) | first step (s) | "
        "step (s, median) | step vs fp32 AdamW |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        rel = f"{r['step_s'] / ref['step_s']:.1f}x" if ref else "n/a"
        lines.append(
            f"| {r['label']} | {r['bytes_per_param']:.3f} | {r['peak_mib']:.0f} | {r['first_s']:.2f} | "
            f"{r['step_s']:.3f} | {rel} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="4 x 1024^2 params instead of 12 x 2048^2")
    ap.add_argument("--steps", type=int, default=4, help="steps per option (the first is reported apart)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.quick, args.steps)))
        return
    rows = run_all(args.quick, args.steps)
    n = rows[0]["params"] if rows else 0
    print(
        f"{n / 1e6:.1f}M params (fp32 linear weights), {args.steps} steps per option, CPU, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}\n"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
