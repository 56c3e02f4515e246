"""Overhead of [numerics] on a training step: the debug model (MXFP8 emulated) on CPU, one rank.

Four runs of the same training: checks off and statistics off; NaN/Inf checks only ("warn", the default);
statistics every 10 steps; statistics every step. The step time is the mean wall-clock gap between consecutive
metrics.jsonl rows (log_freq 1) after the first ``--skip`` steps (compilation, warm-up).

    .venv/bin/python benchmarks/bench_numerics_overhead.py --steps 21 --out /tmp/bench_numerics

``--micro``: the same four cases in-process on a stack of 12 MXFP8 QuantLinear(256, 256) layers (tokens 512),
forward + backward + checks + statistics flush, timed with ``time.process_time`` (CPU time of this process:
much less sensitive to other jobs on a shared machine than the wall clock of a whole training).
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


def micro(steps: int = 20) -> None:
    """The four cases on a QuantLinear stack, CPU time per step (see the module docstring)."""
    import statistics
    import time

    import torch
    from torch import nn

    from low_bits_training.config.numerics import NumericsConfig
    from low_bits_training.formats import QuantSpec
    from low_bits_training.nn import LinearPlan
    from low_bits_training.nn.linear import QuantLinear
    from low_bits_training.nn.roles import ROLE_NAMES
    from low_bits_training.titan.runtime.numerics import NumericsMonitor

    torch.set_num_threads(1)
    torch.manual_seed(0)
    plan = LinearPlan.from_roles(dict.fromkeys(ROLE_NAMES, QuantSpec.mxfp8("e4m3", "rceil")))
    model = nn.Sequential(*[QuantLinear(256, 256, bias=False, plan=plan) for _ in range(12)])
    x = torch.randn(512, 256)  # (tokens, features)
    base = None
    print("| case | CPU ms/step | overhead |  (12 x QuantLinear(256, 256) MXFP8, 512 tokens, 1 thread)")
    print("|---|---|---|")
    for name, kw in CASES.items():
        mon = NumericsMonitor(NumericsConfig(**kw), [model], tempfile.mkdtemp())
        ts = []
        for step in range(1, steps + 1):
            t0 = time.process_time()
            mon.begin_step(step)
            model.zero_grad()
            loss = model(x).square().mean()
            loss.backward()
            mon.after_microbatch(loss.detach())
            mon.flush(None)
            ts.append(time.process_time() - t0)
        mon.close()
        t = statistics.mean(ts[1:])  # step 1 is a statistics step in every "stats" case: left out
        base = base or t
        print(f"| {name} | {1000 * t:.1f} | {100 * (t / base - 1):+.1f}% |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=21)
    p.add_argument("--skip", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--recipe", default="mxfp8")
    p.add_argument("--out", default=None, help="folder for the runs (default: a temp folder)")
    p.add_argument("--micro", action="store_true", help="in-process QuantLinear stack instead of trainings")
    a = p.parse_args()
    if a.micro:
        micro()
        return 0
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
