"""Training-state bytes per parameter against the loss they cost, on the debug model, over several seeds.

Run: .venv/bin/python benchmarks/state_bytes_losses.py [--steps 200] [--seeds 0 1 2] [--only NAME ...]
    [--work DIR] [--corpus DIR] [--json FILE]        (all settings, 3 seeds: about an hour on 2 shared cores)
     .venv/bin/python benchmarks/state_bytes_losses.py --collect FILE [--only NAME ...]   (the tables again)

Each setting is a real torchrun training (1 CPU rank, batch 2 x seq 128, OMP_NUM_THREADS=1, lr 3e-3 with warmup 5
and cosine decay to 0.1, ``--debug.seed`` per seed) of a preset, either as it is (``PRESETS``) or
``train_configs/debug_model.toml`` with its ``[[optimizer.param_groups]]`` replaced and ``training.dtype`` set
(``SETTINGS``). Bytes per parameter are the run's own ``state_bytes.json`` (computed by ``optim.budget`` through
``titan.runtime.budget.planned``, as lbt-doctor's "state bytes" row; the measured side is checked equal). The
final loss is the mean of the last 10 steps (every step logged); the gap is the setting's mean over seeds minus the
reference's (the first setting, fp32 AdamW), the spread is max - min over seeds. Two markdown tables are printed:
the settings, and the presets against the default preset (the first setting: debug_model.toml as it is).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import tomli_w

REPO = Path(__file__).resolve().parents[1]
BASE = {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
LEAN = {"master_weights": "bf16", "master_rounding": "stochastic"}
SETTINGS: dict[str, tuple[str, str, dict]] = {
    # label: (training.dtype, "" to keep the preset's; optimizer_name, optimizer_kwargs beyond BASE)
    "AdamW fp32 (default)": ("", "AdamW", {}),  # debug_model.toml as it is: also the presets' reference
    "LowBitAdamW int8/e4m3 block128, fp32 params": (
        "float32",
        "LowBitAdamW",
        {"exp_avg": "int8_block128", "exp_avg_sq": "e4m3_block128"},
    ),
    "LowBitAdamW int8/e4m3 block128, bf16 params SR": (
        "bfloat16",
        "LowBitAdamW",
        {"exp_avg": "int8_block128", "exp_avg_sq": "e4m3_block128", **LEAN},
    ),
    "LowBitAdamW e2m1/int4 block128, bf16 params SR (lean)": (
        "bfloat16",
        "LowBitAdamW",
        {"exp_avg": "e2m1_block128", "exp_avg_sq": "int4_block128", **LEAN},
    ),
    "LowBitAdamW int4/e2m1 block128, bf16 params SR (lean before issue 40)": (
        "bfloat16",
        "LowBitAdamW",
        {"exp_avg": "int4_block128", "exp_avg_sq": "e2m1_block128", **LEAN},
    ),
    "LowBitAdamW int4/e2m1 block256, bf16 params SR": (
        "bfloat16",
        "LowBitAdamW",
        {"exp_avg": "int4_block256", "exp_avg_sq": "e2m1_block256", **LEAN},
    ),
    "LowBitAdamW int4/e2m1 block256 e8m0 scales, bf16 params SR": (
        "bfloat16",
        "LowBitAdamW",
        {"exp_avg": "int4_block256_e8m0", "exp_avg_sq": "e2m1_block256_e8m0", **LEAN},
    ),
}
PRESETS: dict[str, str] = {
    # label: preset file, trained as it is apart from the common overrides (batch, seq, steps, seed, logging);
    # compared with "AdamW fp32 (default)", which is train_configs/debug_model.toml as it is
    "8B one-GPU twin (debug_one_gpu_twin.toml)": "train_configs/debug_one_gpu_twin.toml",
}
LAST = 10


def _slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label)[:60]


def _config(label: str, folder: Path) -> Path:
    if label in PRESETS:
        return REPO / PRESETS[label]
    dtype, name, extra = SETTINGS[label]
    data = tomllib.loads((REPO / "train_configs" / "debug_model.toml").read_text())
    if dtype:
        data["training"]["dtype"] = dtype
    data["optimizer"] = {
        "param_groups": [{"pattern": ".*", "optimizer_name": name, "optimizer_kwargs": {**BASE, **extra}}]
    }
    (folder / "cfg.toml").write_text(tomli_w.dumps(data))
    return folder / "cfg.toml"


def train(label: str, seed: int, steps: int, work: Path, corpus: str) -> dict | None:
    """One training run: its losses by step and its state bytes per parameter, or None if it failed."""
    folder = work / f"{_slug(label)}_seed{seed}"
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--rdzv_backend=c10d"]
    cmd += ["--rdzv_endpoint=localhost:0", "-m", "low_bits_training.titan.launch.worker"]
    cmd += ["--config-file", str(_config(label, folder)), "--dump_folder", str(folder / "run")]
    cmd += ["--training.local_batch_size", "2", "--training.seq_len", "128", "--training.steps", str(steps)]
    cmd += ["--metrics.log_freq", "1", "--metrics.no-enable-tensorboard", "--checkpoint.no-enable"]
    cmd += ["--debug.seed", str(seed), "--dataloader.dataset_path", corpus]
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(folder / "inductor"), OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if p.returncode:
        print(f"{label} seed {seed}: failed\n{(p.stdout + p.stderr)[-3000:]}", file=sys.stderr)
        return None
    run = folder / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    loss = {r["step"]: r["loss_metrics/global_avg_loss"] for r in rows if "loss_metrics/global_avg_loss" in r}
    sb = json.loads((run / "state_bytes.json").read_text())
    return {
        "loss": loss,
        "planned": sb["planned"]["bytes_per_param"],
        "measured": sb["measured"]["bytes_per_param"]["total"],
        "formats": sb["planned"]["formats"],
    }


def final(run: dict, steps: int) -> float:
    """Mean loss of the last ``LAST`` steps."""
    return statistics.fmean(run["loss"][s] for s in range(steps - LAST + 1, steps + 1))


def _row(label: str, runs: dict[int, dict], ref: list[float], steps: int, seeds: list[int]) -> list[str]:
    if any(runs.get(s) is None for s in seeds):
        return [label, "failed"] + [""] * 6
    finals = [final(runs[s], steps) for s in seeds]
    per = runs[seeds[0]]["planned"]
    parts = " / ".join(f"{per[k]:.2f}" for k in ("params", "grads", "exp_avg", "exp_avg_sq"))
    mean = statistics.fmean(finals)
    gap = f"{mean - statistics.fmean(ref):+.4f}" if ref else "n/a"
    paired = [f - r for f, r in zip(finals, ref, strict=True)] if ref else []
    paired_s = ", ".join(f"{x:+.4f}" for x in paired)
    measured = runs[seeds[0]]["measured"]
    total = f"{per['total']:.2f}" + (
        "" if abs(measured - per["total"]) < 5e-3 else f" (measured {measured:.2f})"
    )
    return [
        label,
        total,
        parts,
        ", ".join(f"{x:.4f}" for x in finals),
        f"{mean:.4f}",
        f"{max(finals) - min(finals):.4f}",
        gap,
        paired_s,
    ]


def table(results: dict[str, dict[int, dict]], steps: int, seeds: list[int], ref_label: str) -> str:
    head = [
        "setting",
        "B/param",
        "params / grads / exp_avg / exp_avg_sq",
        f"final loss per seed ({', '.join(map(str, seeds))})",
        "mean",
        "spread (max-min)",
        f"gap vs {ref_label.split(' (')[0]} (means)",
        "gap per seed",
    ]
    ref_runs = results.get(ref_label, {})
    ref = [final(ref_runs[s], steps) for s in seeds] if all(ref_runs.get(s) for s in seeds) else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, runs in results.items():
        lines.append("| " + " | ".join(_row(label, runs, ref, steps, seeds)) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--only", nargs="*", default=None, help="labels to run (default: all, in this order)")
    ap.add_argument("--work", default=None, help="folder for the runs (default: a temporary one, removed)")
    ap.add_argument(
        "--corpus", default="./assets/lbt_markov", help="the Markov corpus folder (built if missing)"
    )
    ap.add_argument("--json", default=None, help="also write every run's losses and bytes here")
    ap.add_argument("--collect", default=None, help="train nothing: print the tables of a --json file")
    args = ap.parse_args()
    if args.steps < LAST:
        ap.error(f"--steps must be at least {LAST}")
    labels = args.only or [*SETTINGS, *PRESETS]
    unknown = [x for x in labels if x not in SETTINGS and x not in PRESETS]
    if unknown:
        ap.error(f"unknown label(s) {unknown}; known: {[*SETTINGS, *PRESETS]}")
    corpus = str(Path(args.corpus).resolve())
    if args.collect:
        saved = json.loads(Path(args.collect).read_text())
        results = {k: {s: _ints(saved[k].get(str(s))) for s in args.seeds} for k in labels if k in saved}
        print_tables(results, args.steps, args.seeds)
        return
    with tempfile.TemporaryDirectory(prefix="lbt-state-bytes-") as tmp:
        work = Path(args.work) if args.work else Path(tmp)
        results: dict[str, dict[int, dict]] = {}
        for label in labels:  # seeds innermost: a cut run keeps whole settings
            results[label] = {s: train(label, s, args.steps, work, corpus) for s in args.seeds}
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1))
    print_tables(results, args.steps, args.seeds)


def _ints(run: dict | None) -> dict | None:
    """A run read back from JSON: its step keys as ints again."""
    return run and {**run, "loss": {int(k): v for k, v in run["loss"].items()}}


def print_tables(results: dict[str, dict[int, dict]], steps: int, seeds: list[int]) -> None:
    print(
        f"Debug model, {steps} steps, batch 2 x seq 128, 1 CPU rank, OMP_NUM_THREADS=1, seeds {seeds}, "
        f"lr 3e-3 warmup 5 cosine; final loss = mean of the last {LAST} steps.\n"
    )
    settings = {k: v for k, v in results.items() if k in SETTINGS}
    ref = "AdamW fp32 (default)"
    presets = {k: v for k, v in results.items() if k in PRESETS or k == ref}
    if settings:
        print(table(settings, steps, seeds, ref) + "\n")
    if len(presets) > 1:
        print(table(presets, steps, seeds, ref))


if __name__ == "__main__":
    main()
