"""Train the debug model with every recipe preset (same seed, same data) and print final losses as markdown.

    .venv/bin/python benchmarks/recipe_losses.py --steps 20 [--recipes bf16,fp8_rowwise]

Each run: ``train_configs/recipes/debug_<recipe>.toml`` on one CPU rank, batch 2 x 128 tokens, no checkpoint.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import train  # noqa: E402
from low_bits_training.nn.recipes import RECIPES  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--recipes", default=",".join(RECIPES))
    args = p.parse_args()
    rows = []
    for recipe in args.recipes.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            run = train(
                Path(tmp),
                "--training.steps",
                str(args.steps),
                "--checkpoint.no-enable",
                "--debug.seed",
                "0",
                config=REPO / "train_configs" / "recipes" / f"debug_{recipe}.toml",
            )
            loss = run.losses
        rows.append((recipe, loss[1], loss[args.steps]))
        print(f"{recipe}: {loss[1]:.4f} -> {loss[args.steps]:.4f}", file=sys.stderr, flush=True)
    base = dict((r, last) for r, _, last in rows).get("bf16")
    print(f"| recipe | loss step 1 | loss step {args.steps} | vs bf16 |\n|---|---:|---:|---:|")
    for recipe, first, last in rows:
        delta = "" if base is None else f"{last - base:+.4f}"
        print(f"| {recipe} | {first:.4f} | {last:.4f} | {delta} |")


if __name__ == "__main__":
    main()
