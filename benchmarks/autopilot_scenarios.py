"""The autopilot's scenarios: a plan that overflows, a plan whose gradients underflow, a benign plan.

    .venv/bin/python benchmarks/autopilot_scenarios.py --steps 200 [--compile] [--scenarios nan,stall,benign]

Trains the debug model (``train_configs/debug_model.toml``, one CPU rank, batch 2 x 128 tokens, same seed and
data, no checkpoint) through the launcher, and prints a markdown table per scenario: each arm's final loss,
its largest loss difference to the bf16 run over the last 20 steps, whether every loss was finite, the
autopilot's decisions, and the median step time of steps 2.. (``time`` in ``metrics.jsonl`` between rows).

- nan: ``layers.1.feed_forward.w1`` forward.input in an unscaled, non-saturating e2m5 (overflow to inf at
  3.875 and above); arms: autopilot off (``numerics.nonfinite = "stop"``: the run stops at the first
  NaN, exit 3), autopilot on (ladder e2m5 -> e4m3 -> high), bf16.
- stall: every block's gradients (``dgrad`` / ``wgrad`` grad_output) in unscaled e5m2 (most of them
  flush to zero); arms: autopilot off, on (default ladder: high), bf16.
- benign: mxfp8 everywhere; arms: autopilot off, on (the default triggers, statistics every 10 steps):
  the decisions (none expected) and the step time the watching costs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import train, write_toml  # noqa: E402

NAN_RULE = {
    "layers": ["layers.1.feed_forward.w1"],
    "roles": ["forward.input"],
    "format": "e2m5",
    "scaling": "none",
    "saturate": False,
}
STALL_RULE = {"layers": ["layers.*"], "roles": ["*.grad_output"], "format": "e5m2", "scaling": "none"}
ON = {"enable": True}
SCENARIOS = {
    "nan": {
        "off (nonfinite = stop)": ({"recipe": "bf16", "rules": [NAN_RULE]}, "stop"),
        "autopilot": (
            {"recipe": "bf16", "rules": [NAN_RULE], "autopilot": {**ON, "ladder": ["e2m5", "e4m3", "high"]}},
            "warn",
        ),
        "bf16": ({"recipe": "bf16"}, "warn"),
    },
    "stall": {
        "off": ({"recipe": "bf16", "rules": [STALL_RULE]}, "warn"),
        "autopilot": ({"recipe": "bf16", "rules": [STALL_RULE], "autopilot": ON}, "warn"),
        "bf16": ({"recipe": "bf16"}, "warn"),
    },
    "benign": {
        "off": ({"recipe": "mxfp8"}, "warn"),
        "autopilot": ({"recipe": "mxfp8", "autopilot": ON}, "warn"),
    },
}


def _train(steps: int, quantize: dict, nonfinite: str, extra: list[str]):
    """One launcher run: losses by step, decisions, median seconds per step after the first, exit code."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = write_toml(tmp / "cfg.toml", quantize=quantize, numerics={"nonfinite": nonfinite})
        args = ("--training.steps", str(steps), "--checkpoint.no-enable", *extra)
        run = train(tmp, *args, config=cfg, check=False)
        rows = [r for r in run.rows if "loss_metrics/global_avg_loss" in r]
        times = [b["time"] - a["time"] for a, b in zip(rows, rows[1:], strict=False)]
        path = run.folder / "autopilot.jsonl"
        decisions = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        return run.losses, decisions, statistics.median(times) if times else math.nan, run.returncode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = p.parse_args()
    extra = ["--compile.enable"] if args.compile else []
    for name in args.scenarios.split(","):
        results = {arm: _train(args.steps, q, nf, extra) for arm, (q, nf) in SCENARIOS[name].items()}
        ref = results.get("bf16", results.get("off"))[0]
        tail = range(max(1, args.steps - 19), args.steps + 1)
        print(f"\n{name}: {args.steps} steps, compile={args.compile}\n")
        print(
            "| arm | exit | final loss | max abs diff to the reference, last 20 steps | all finite | decisions | s/step |"
        )
        print("|---|---|---|---|---|---|---|")
        for arm, (losses, decisions, sec, code) in results.items():
            finite = all(math.isfinite(v) for v in losses.values()) and len(losses) == args.steps
            diff = max((abs(losses[s] - ref[s]) for s in tail if s in losses and s in ref), default=math.nan)
            said = "; ".join(f"{d['step']}: {d['layer']} {d['role']} -> {d['after']}" for d in decisions[:3])
            more = f" (+{len(decisions) - 3})" if len(decisions) > 3 else ""
            final = losses.get(args.steps, math.nan)
            row = f"| {arm} | {code} | {final:.4f} | {diff:.4f} | {finite} | {said or 'none'}{more} | {sec:.3f} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
