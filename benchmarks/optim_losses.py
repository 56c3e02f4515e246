"""Train the debug model with each optimizer option and print a markdown table of losses vs fp32 AdamW.

Run: .venv/bin/python benchmarks/optim_losses.py [--steps 30] [--only NAME ...]
Each option is a real torchrun training (1 CPU rank, batch 2 x seq 128, seed 0) of
train_configs/debug_model.toml with its ``[[optimizer.param_groups]]`` replaced.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import tomli_w

REPO = Path(__file__).resolve().parents[1]
BASE = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
OPTIONS: dict[str, tuple[str, dict]] = {
    "AdamW fp32 (torch)": ("AdamW", {}),
    "LowBitAdamW bf16/bf16": ("LowBitAdamW", {"exp_avg": "bf16", "exp_avg_sq": "bf16"}),
    "LowBitAdamW int8/e4m3": ("LowBitAdamW", {"exp_avg_sq": "e4m3_block128"}),
    "LowBitAdamW int8/int8": ("LowBitAdamW", {"exp_avg": "int8_block128", "exp_avg_sq": "int8_block128"}),
    "LowBitAdamW int4/e2m1 block128": (
        "LowBitAdamW",
        {"exp_avg": "int4_block128", "exp_avg_sq": "e2m1_block128"},
    ),
    "LowBitAdamW int8/e4m3 + bf16 master SR": (
        "LowBitAdamW",
        {"exp_avg_sq": "e4m3_block128", "master_weights": "bf16", "master_rounding": "stochastic"},
    ),
    "LowBitAdamW int8/e4m3 + bf16 master Kahan": (
        "LowBitAdamW",
        {"exp_avg_sq": "e4m3_block128", "master_weights": "bf16", "master_rounding": "kahan"},
    ),
    "LowBitAdamW fp32 states + bf16 master RNE": (
        "LowBitAdamW",
        {"exp_avg": "fp32", "exp_avg_sq": "fp32", "master_weights": "bf16"},
    ),
    "LowBitSGD int8 momentum (lr 0.3)": (
        "LowBitSGD",
        {"lr": 0.3, "momentum": 0.9, "momentum_buffer": "int8_block128"},
    ),
    "torchao AdamW8bit": ("AdamW8bit", {}),
    "torchao AdamW4bit": ("AdamW4bit", {}),
    "torchao AdamWFp8": ("AdamWFp8", {}),
}


def _kwargs(name: str, extra: dict) -> dict:
    kw = {**BASE, **extra}
    if name == "LowBitSGD":
        kw = {k: v for k, v in kw.items() if k not in ("betas", "eps")}
    return kw


def train(label: str, steps: int, work: Path) -> dict[int, float]:
    """One training run; returns step -> loss."""
    name, extra = OPTIONS[label]
    data = tomllib.loads((REPO / "train_configs" / "debug_model.toml").read_text())
    data["optimizer"] = {
        "param_groups": [{"pattern": ".*", "optimizer_name": name, "optimizer_kwargs": _kwargs(name, extra)}]
    }
    folder = work / label.replace(" ", "_").replace("/", "-")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cfg.toml").write_text(tomli_w.dumps(data))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        "-m",
        "low_bits_training.titan.launch.worker",
        "--config-file",
        str(folder / "cfg.toml"),
        "--dump_folder",
        str(folder / "run"),
        "--training.local_batch_size",
        "2",
        "--training.seq_len",
        "128",
        "--training.steps",
        str(steps),
        "--metrics.log_freq",
        "1",
        "--metrics.no-enable-tensorboard",
        "--checkpoint.no-enable",
        "--debug.seed",
        "0",
    ]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor"), OMP_NUM_THREADS="2")
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if p.returncode:
        print(f"{label}: failed\n{(p.stdout + p.stderr)[-3000:]}", file=sys.stderr)
        return {}
    rows = [json.loads(x) for x in (folder / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss_metrics/global_avg_loss"] for r in rows if "loss_metrics/global_avg_loss" in r}


def table(results: dict[str, dict[int, float]], steps: int) -> str:
    ref = results.get("AdamW fp32 (torch)", {})
    last = lambda d: sum(d[s] for s in range(steps - 4, steps + 1)) / 5  # noqa: E731 mean of the last 5 steps
    lines = [
        "| optimizer | loss step 1 | loss step 10 | loss last step | mean last 5 | vs fp32 AdamW (mean last 5) |",
        "|---|---|---|---|---|---|",
    ]
    for label, d in results.items():
        if len(d) < steps:
            lines.append(f"| {label} | failed | | | | |")
            continue
        delta = f"{last(d) - last(ref):+.4f}" if len(ref) >= steps else "n/a"
        lines.append(f"| {label} | {d[1]:.4f} | {d[10]:.4f} | {d[steps]:.4f} | {last(d):.4f} | {delta} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--only", nargs="*", default=None, help="labels to run (default: all)")
    args = ap.parse_args()
    labels = args.only or list(OPTIONS)
    with tempfile.TemporaryDirectory(prefix="lbt-optim-losses-") as work:
        results = {label: train(label, args.steps, Path(work)) for label in labels}
    print(
        f"Debug model, {args.steps} steps, batch 2 x seq 128, 1 CPU rank, seed 0, lr 3e-3 warmup 5 cosine.\n"
    )
    print(table(results, args.steps))


if __name__ == "__main__":
    main()
