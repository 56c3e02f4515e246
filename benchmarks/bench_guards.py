"""What dynamo's guards cost the fused optimizer step: LowBitAdamW's default step compiled with the guards
``optim.fused.kept_guards`` keeps (tensors, shapes, global state: what the optimizer runs) against the same
update compiled with every guard, and torch's foreach AdamW, on one of ``bench_optim``'s parameter mixes.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_guards.py [--steps 60] [--mix "debug Llama ..."]

All three in one process on their own copies of the same fp32 weights (shared gradients), three warm-up steps
(the first compiles), then the timed steps interleaved; medians and minima. The two LowBitAdamW copies must
end with equal parameters (the guards choose a compiled kernel, they do not change it): the script exits 1
if they do not. Nothing else is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_optim import SPEED_MIXES, _speed_opt  # noqa: E402

from low_bits_training.optim import fused  # noqa: E402

_EVERY_GUARD: dict = {}


def _every_guard(spec):
    """The compiled update of ``spec`` as it was before ``kept_guards``: every guard dynamo makes."""
    if spec not in _EVERY_GUARD:
        options = {k: v for k, v in fused._OPTIONS.items() if k != "guard_filter_fn"}
        _EVERY_GUARD[spec] = torch.compile(fused._own_copy(spec), fullgraph=True, options=options)
    return _EVERY_GUARD[spec]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60, help="timed steps of each optimizer")
    ap.add_argument(
        "--mix", default=next(m for m in SPEED_MIXES if m.startswith("debug")), choices=SPEED_MIXES
    )
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    shapes = SPEED_MIXES[args.mix]
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g).mul_(1e-3) for s in shapes]
    kept = fused.compiled_update
    runs = {}
    for label in ("LowBitAdamW, every guard", "LowBitAdamW, kept_guards", "torch AdamW (foreach)"):
        params = [t.clone().requires_grad_() for t in init]
        for p, gr in zip(params, grads, strict=True):
            p.grad = gr
        kind, extra = ("torch", {"foreach": True}) if label.startswith("torch") else ("LowBitAdamW", {})
        opt = _speed_opt(kind, extra, params)  # bench_optim's hyperparameters and parameter names
        runs[label] = (opt, params, _every_guard if "every" in label else kept, [])
    for k in range(3 + args.steps):
        for opt, _, compiled, times in runs.values():
            fused.compiled_update = compiled  # run_fused looks it up at each call
            t = time.perf_counter()
            opt.step()
            if k >= 3:
                times.append(time.perf_counter() - t)
    fused.compiled_update = kept
    print(f"{args.mix}, {args.steps} interleaved steps, one thread")
    print("| optimizer | median ms | min ms |\n|---|---|---|")
    for label, (_, _, _, times) in runs.items():
        print(f"| {label} | {statistics.median(times) * 1e3:.2f} | {min(times) * 1e3:.2f} |")
    a, b = (runs[k][1] for k in ("LowBitAdamW, every guard", "LowBitAdamW, kept_guards"))
    same = all(torch.equal(p, q) for p, q in zip(a, b, strict=True))
    print(f"LowBitAdamW parameters equal with and without the dropped guards: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
