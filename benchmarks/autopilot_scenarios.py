"""The autopilot's scenarios: a plan that overflows, a plan whose gradients underflow, a benign plan.

    .venv/bin/python benchmarks/autopilot_scenarios.py --steps 200 [--compile] [--scenarios nan,stall,benign]

Trains the debug model (``train_configs/debug_model.toml``, one CPU rank, batch 2 x 128 tokens, same seed and
data, no checkpoint) through the launcher, and prints a markdown table per scenario: each arm's final loss,
its largest loss difference to the reference run (bf16; for the spike, the run without the fault) over the
last 20 steps, whether every loss was finite, the autopilot's decisions, and the median step time of steps
2.. (``time`` in ``metrics.jsonl`` between rows).

- nan: ``layers.1.feed_forward.w1`` forward.input in an unscaled, non-saturating e2m5 (overflow to inf at
  3.875 and above); arms: autopilot off (``numerics.nonfinite = "stop"``: the run stops at the first
  NaN, exit 3), autopilot on (ladder e2m5 -> e4m3 -> high), bf16.
- stall: every block's gradients (``dgrad`` / ``wgrad`` grad_output) in unscaled e5m2 (most of them
  flush to zero); arms: autopilot off, on (default ladder: high), bf16.
- benign: mxfp8 everywhere; arms: autopilot off, on (the default triggers, statistics every 10 steps):
  the decisions (none expected) and the step time the watching costs.
- spike: mxfp8, the final norm's output scaled 30x at step ``--spike-step`` (a one-step transient fault,
  ``tests/titan/nan_override.spike_norm``); arms: autopilot off, on (default spike trigger, ``on_spike =
  "rollback"``: back to a host snapshot, same plan), and the run without the fault as the reference.

A run two scenarios share (the bf16 reference, the plain mxfp8 run) runs once. Time the runs on a quiet
machine: the s/step column is what the benign scenario's watching cost is read from.
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
    "spike": {
        "off": ({"recipe": "mxfp8"}, "warn", "spiked"),
        "autopilot": ({"recipe": "mxfp8", "autopilot": {**ON, "on_spike": "rollback"}}, "warn", "spiked"),
        "no fault": ({"recipe": "mxfp8"}, "warn"),  # the reference: the benign scenario's "off" run
    },
}
SPIKE_ARGS = ["--override.imports", "tests.titan.nan_override.spike_norm"]


def _train(steps: int, quantize: dict, nonfinite: str, extra: list[str], env: dict | None = None):
    """One launcher run: losses by step, decisions, median seconds per step after the first, exit code."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cfg = write_toml(tmp / "cfg.toml", quantize=quantize, numerics={"nonfinite": nonfinite})
        args = ("--training.steps", str(steps), "--checkpoint.no-enable", *extra)
        run = train(tmp, *args, config=cfg, check=False, env=env, timeout=7200)
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
    p.add_argument("--spike-step", type=int, default=150, help="the spike scenario's faulty step")
    args = p.parse_args()
    extra = ["--compile.enable"] if args.compile else []
    done: dict[str, tuple] = {}
    for name in args.scenarios.split(","):
        results = {}
        for arm, (q, nf, *fault) in SCENARIOS[name].items():
            more, env = (SPIKE_ARGS, {"LBT_TEST_SPIKE_CALL": str(args.spike_step)}) if fault else ([], None)
            key = json.dumps([q, nf, more, env], sort_keys=True)  # the same run in two scenarios runs once
            if key not in done:
                done[key] = _train(args.steps, q, nf, [*extra, *more], env)
            results[arm] = done[key]
        ref = next(results[a] for a in ("bf16", "no fault", "off") if a in results)[0]
        tail = range(max(1, args.steps - 19), args.steps + 1)
        print(f"\n{name}: {args.steps} steps, compile={args.compile}\n")
        print(
            "| arm | exit | final loss | max abs diff to the reference, last 20 steps | all finite | decisions | s/step |"
        )
        print("|---|---|---|---|---|---|---|")
        for arm, (losses, decisions, sec, code) in results.items():
            finite = all(math.isfinite(v) for v in losses.values()) and len(losses) == args.steps
            diff = max((abs(losses[s] - ref[s]) for s in tail if s in losses and s in ref), default=math.nan)
            said = "; ".join(
                f"{d['step']}: {d['layer']} {d['role']} -> {d['after']}"
                if d["layer"]
                else f"{d['step']}: rollback ({d['trigger']} at step {d['seen']}, z {d['value']:.0f})"
                for d in decisions[:3]
            )
            more = f" (+{len(decisions) - 3})" if len(decisions) > 3 else ""
            final = losses.get(args.steps, math.nan)
            row = f"| {arm} | {code} | {final:.4f} | {diff:.4f} | {finite} | {said or 'none'}{more} | {sec:.3f} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
