"""Train the debug model with recipe presets (same data, one or more seeds) and print final losses as markdown.

    .venv/bin/python benchmarks/recipe_losses.py --steps 20 [--recipes bf16,fp8_rowwise] [--seeds 0,1,2]

Each run: ``train_configs/recipes/debug_<recipe>.toml`` on one CPU rank through ``run_llama_train.sh``, batch
2 x 128 tokens, no checkpoint, ``--debug.seed`` per seed. A recipe without its own preset (the vendor-equal ones,
``nvfp4_te``, ``nvfp4_torchao``, ``fp8_block_te``...) trains ``train_configs/debug_model.toml`` with
``[quantize] recipe = <recipe>, backend = "emulate", skip = ["lm_head"]``, which is what the presets are.
With one seed the final loss is the last step's (the table this script printed before); with several it is the mean
of the last 10 steps, and the table gives each seed, the mean, the spread (max - min) and the mean's gap to the
first recipe.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import DEBUG_TOML, train, write_toml  # noqa: E402
from low_bits_training.nn.recipes import RECIPES  # noqa: E402

LAST = 10


def run_losses(recipe: str, seed: int, steps: int) -> dict[int, float]:
    with tempfile.TemporaryDirectory() as tmp:
        config = REPO / "train_configs" / "recipes" / f"debug_{recipe}.toml"
        if not config.exists():
            quantize = {"recipe": recipe, "backend": "emulate", "skip": ["lm_head"]}
            config = write_toml(Path(tmp) / f"debug_{recipe}.toml", DEBUG_TOML, quantize=quantize)
        args = ("--training.steps", str(steps), "--checkpoint.no-enable", "--debug.seed", str(seed))
        return train(Path(tmp), *args, config=config, timeout=3600).losses


def one_seed_table(rows: dict[str, dict[int, dict[int, float]]], steps: int) -> str:
    finals = {r: runs[min(runs)] for r, runs in rows.items()}
    base = finals.get("bf16")
    lines = [f"| recipe | loss step 1 | loss step {steps} | vs bf16 |", "|---|---:|---:|---:|"]
    for recipe, loss in finals.items():
        delta = "" if base is None else f"{loss[steps] - base[steps]:+.4f}"
        lines.append(f"| {recipe} | {loss[1]:.4f} | {loss[steps]:.4f} | {delta} |")
    return "\n".join(lines)


def seeds_table(rows: dict[str, dict[int, dict[int, float]]], steps: int, seeds: list[int]) -> str:
    def final(loss: dict[int, float]) -> float:
        return statistics.fmean(loss[s] for s in range(steps - LAST + 1, steps + 1))

    means = {r: statistics.fmean(final(runs[s]) for s in seeds) for r, runs in rows.items()}
    ref = next(iter(rows))
    lines = [
        f"| recipe | final loss per seed ({', '.join(map(str, seeds))}), mean of steps {steps - LAST + 1}-{steps} "
        f"| mean | spread | vs {ref} |",
        "|---|---|---:|---:|---:|",
    ]
    for recipe, runs in rows.items():
        finals = [final(runs[s]) for s in seeds]
        per = ", ".join(f"{v:.4f}" for v in finals)
        gap = means[recipe] - means[ref]
        lines.append(
            f"| {recipe} | {per} | {means[recipe]:.4f} | {max(finals) - min(finals):.4f} | {gap:+.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--recipes", default=",".join(RECIPES))
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows: dict[str, dict[int, dict[int, float]]] = {}
    for recipe in args.recipes.split(","):
        for seed in seeds:
            loss = run_losses(recipe, seed, args.steps)
            rows.setdefault(recipe, {})[seed] = loss
            print(
                f"{recipe} seed {seed}: {loss[1]:.4f} -> {loss[args.steps]:.4f}", file=sys.stderr, flush=True
            )
    print(one_seed_table(rows, args.steps) if len(seeds) == 1 else seeds_table(rows, args.steps, seeds))


if __name__ == "__main__":
    main()
