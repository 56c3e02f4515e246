"""Saved activations in low precision: bytes per token and the loss against the run that keeps them as made.

    .venv/bin/python benchmarks/saved_losses.py --steps 200 [--compile] [--ac selective]
    .venv/bin/python benchmarks/saved_losses.py --steps 200 --presets train_configs/debug_model.toml \
        train_configs/debug_lean.toml

Trains the debug model (``train_configs/debug_model.toml``, one CPU rank, batch 2 x 128 tokens, same seed
and data, no checkpoint) through the launcher once per ``[[quantize.saved]]`` variant below, and prints a
markdown table: the stored and as-made saved bytes per token of the last step (the ``saved/*`` metrics,
what the hooks packed: parameters, softmax statistics and small tensors are kept and counted as made), their
ratio, the final loss and the largest loss difference to the run without rules over all steps; and what the
allocator held for the same saves on step 2 (``state_bytes.json``, docs/memory.md "The allocator's view").
``--presets``: each config as it is (its own saves and optimizer), with its training-state bytes per
parameter (``state_bytes.json``), against the first one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import train, write_toml  # noqa: E402

HIGH = {"modules": ["layers.*"], "format": "high"}
VARIANTS = {
    "as made (counted)": [HIGH],
    "bf16": [{"modules": ["layers.*"], "format": "bf16"}],
    "e4m3 per row (default)": [{"modules": ["layers.*"], "format": "e4m3"}],
    "e4m3 per tensor": [{"modules": ["layers.*"], "format": "e4m3", "scaling": "tensor"}],
    "e4m3 MX (block 32, e8m0)": [
        {
            "modules": ["layers.*"],
            "format": "e4m3",
            "scaling": "block",
            "block_size": 16,
            "scale_format": "e8m0",
            "scale_rounding": "rceil",
        }
    ],  # fmt: skip
}
"""Rule sets by name. The MX variant uses 16-element blocks: the debug model's head dim is 16."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--ac", default="none", choices=["none", "selective", "full"])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--presets", nargs="+", type=Path, help="config files to train as they are")
    args = p.parse_args()
    if args.presets:
        return presets(args)
    extra = ["--activation_checkpoint", args.ac, *(["--compile.enable"] if args.compile else [])]
    rows, ref = [], None
    for name in args.variants.split(","):
        losses, last, state = _train(args.steps, {"saved": VARIANTS[name]}, extra)
        ref = ref or losses
        tokens = last["saved/bytes"] / last["saved/bytes_per_token"]
        held = state["saved_bytes_per_token"]["allocator"]
        rows.append(
            f"| {name} | {last['saved/bytes'] / tokens:,.0f} | {held:,.0f} | {last['saved/bytes_hp'] / tokens:,.0f} | "
            f"{last['saved/bytes_hp'] / last['saved/bytes']:.2f}x | {_losses(losses, ref, args.steps)} |"
        )
        print(rows[-1], flush=True)
    print(f"\n{args.steps} steps, compile={args.compile}, activation_checkpoint={args.ac}\n")
    print(
        "| saves | stored B/token | held by the allocator (step 2) | as made B/token | fewer bytes | final loss | "
        "vs first | max abs loss diff |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))


def _train(steps: int, quantize: dict | None, extra: list[str], config: Path | None = None):
    """One launcher run: its losses, its last ``saved/*`` metrics row, its ``state_bytes.json``."""
    with tempfile.TemporaryDirectory() as tmp:
        if quantize is not None:
            config = write_toml(Path(tmp) / "saved.toml", quantize=quantize)
        run = train(
            Path(tmp), "--training.steps", str(steps), "--checkpoint.no-enable", "--debug.seed", "0",
            "--metrics.log_freq", "1", *extra, config=config, timeout=7200,
        )  # fmt: skip
        last = ([r for r in run.rows if "saved/bytes" in r] or [{}])[-1]
        return run.losses, last, json.loads((run.folder / "state_bytes.json").read_text())


def _losses(losses: dict, ref: dict, steps: int) -> str:
    """final loss | its difference to the first run's | the largest difference over all steps"""
    diff = max(abs(losses[s] - ref[s]) for s in losses)
    return f"{losses[steps]:.4f} | {losses[steps] - ref[steps]:+.4f} | {diff:.4f}"


def presets(args) -> None:
    rows, ref = [], None
    for config in args.presets:
        losses, _, state = _train(args.steps, None, [], config)
        ref = ref or losses
        per_param = state["measured"]["bytes_per_param"]["total"]
        saved = (state.get("saved_bytes_per_token") or {}).get("stored")
        rows.append(
            f"| {config} | {per_param:.2f} | {f'{saved:,.0f}' if saved else 'not counted'} | "
            f"{_losses(losses, ref, args.steps)} |"
        )
        print(rows[-1], flush=True)
    print(f"\n{args.steps} steps\n")
    print("| config | state B/param | saved B/token | final loss | vs first | max abs loss diff |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
