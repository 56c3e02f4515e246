"""Overhead of [numerics] on a training step: the debug model (MXFP8 emulated) on CPU, one rank.

Four runs of the same training: checks off and statistics off; NaN/Inf checks only ("warn", the default);
statistics every 10 steps; statistics every step. The step time is the mean wall-clock gap between consecutive
metrics.jsonl rows (log_freq 1) after the first ``--skip`` steps (compilation, warm-up).

    .venv/bin/python benchmarks/bench_numerics_overhead.py --steps 21 --out /tmp/bench_numerics
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import train, write_toml  # noqa: E402

CASES = {
    "off": {"stats_freq": 0, "nonfinite": "off"},
    "checks only (warn)": {"stats_freq": 0, "nonfinite": "warn"},
    "stats every 10": {"stats_freq": 10, "nonfinite": "warn"},
    "stats every step": {"stats_freq": 1, "nonfinite": "warn"},
}


def step_time(rows: list[dict], skip: int) -> float:
    """Mean seconds per step from the ``time`` of consecutive rows, after ``skip`` steps."""
    t = [r["time"] for r in rows if r["step"] > skip]
    return (t[-1] - t[0]) / (len(t) - 1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=21)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--recipe", default="mxfp8")
    p.add_argument("--out", default=None, help="folder for the runs (default: a temp folder)")
    a = p.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="bench_numerics_"))
    base = None
    print(
        f"| case | s/step | overhead |  (debug model, {a.recipe}, batch {a.batch} x seq {a.seq}, 1 CPU rank)"
    )
    print("|---|---|---|")
    for i, (name, numerics) in enumerate(CASES.items()):
        folder = out / f"case{i}"
        folder.mkdir(parents=True, exist_ok=True)
        cfg = write_toml(folder / "cfg.toml", quantize={"recipe": a.recipe}, numerics=numerics)
        run = train(
            folder,
            "--training.steps",
            str(a.steps),
            "--checkpoint.no-enable",
            "--training.local_batch_size",
            str(a.batch),
            "--training.seq_len",
            str(a.seq),
            config=cfg,
        )
        t = step_time(run.rows, a.skip)
        base = base or t
        print(f"| {name} | {t:.3f} | {100 * (t / base - 1):+.1f}% |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
