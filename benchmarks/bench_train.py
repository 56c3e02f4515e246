"""End-to-end training speed per recipe, as the user feels it: the debug model through ``run_llama_train.sh``.

Trains the debug model (1 CPU rank, seed 0, batch 4 x 256, the preset's defaults otherwise: AdamW, NaN checks
on) for bf16 and every recipe, eager and ``--compile.enable``, plus torchao's modules (their emulated modes on
CPU) through the ``torchao`` backend, in one run, and prints each step time as a ratio to bf16 in the same mode.
Step time: the median gap between consecutive metrics rows after the first ``--skip`` steps (compilation and
warm-up left out; the median shrugs off steps slowed by other jobs). Whole runs of the same code vary more
than steps within a run (10-15% on a shared 2-core VM); ``--repeats N`` trains every case N times, in
interleaved rounds, and reports the median of the N runs' step times with their range.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_train.py                 # everything (~30 min, 2 cores)
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_train.py --modes compiled --repeats 3
    .venv/bin/python benchmarks/bench_train.py --recipes bf16 mxfp8 --modes compiled --steps 10

The last column compares the final losses of the compiled and eager runs of a recipe (same seed, same data).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from low_bits_training.cli.runner import REPO, run_local
from low_bits_training.nn.kernels import machine_line
from low_bits_training.nn.recipes import RECIPES
from low_bits_training.run.folder import read_metrics

AIMS = {"fp8": 1.15, "mx": 1.3, "nvfp4": 1.4}
"""Issue 11's aims for the compiled step time relative to compiled bf16, by recipe family."""
TORCHAO_CASES = {"torchao:fp8_tensorwise": "fp8_tensorwise", "torchao:fp8_rowwise": "fp8_rowwise",
                 "torchao:mxfp8": "mxfp8"}  # fmt: skip
"""Rows run by torchao's modules (backend "torchao": emulated mode on CPU) -> the recipe they compute."""


def aim(recipe: str) -> float | None:
    """The compiled-step aim of a recipe (None: none set)."""
    name = recipe.split(":")[-1]
    if name.startswith(("fp8", "deepseek")):
        return AIMS["fp8"]
    if name.startswith("mx"):
        return AIMS["mx"]
    return AIMS["nvfp4"] if name.startswith("nvfp4") else None


def step_time(rows: list[dict], skip: int) -> float:
    """Median seconds between consecutive logged steps after ``skip`` steps."""
    t = [r["time"] for r in rows if r["step"] > skip and "time" in r]
    return statistics.median(b - a for a, b in zip(t, t[1:], strict=False)) if len(t) > 1 else float("nan")


def run_case(out: Path, case: str, mode: str, a) -> tuple[float, float]:
    """Train one (case, mode); returns (median s/step, final loss)."""
    recipe = TORCHAO_CASES.get(case, case)
    args = [
        "--training.steps", str(a.steps), "--checkpoint.no-enable", "--training.local_batch_size", "4",
        "--training.seq_len", "256", "--metrics.log_freq", "1", "--metrics.no-enable-tensorboard",
        "--quantize.recipe", recipe, "--quantize.backend", "torchao" if case in TORCHAO_CASES else "emulate",
    ]  # fmt: skip
    if mode == "compiled":
        args.append("--compile.enable")
    folder = out / f"{case.replace(':', '_')}_{mode}"
    res = run_local(str(REPO / "train_configs" / "debug_model.toml"), folder, args)
    rows = read_metrics(folder)
    if res.returncode or not rows:
        print(f"  {case} {mode}: failed (exit {res.returncode}; see {folder}/train.log)", file=sys.stderr)
        return float("nan"), float("nan")
    losses = [r["loss_metrics/global_avg_loss"] for r in rows if "loss_metrics/global_avg_loss" in r]
    return step_time(rows, a.skip), losses[-1]


def summary(runs: list[tuple[float, float]]) -> tuple[float, float, float, float]:
    """(median s/step, fastest, slowest, final loss of the first run) over the repeats of one case."""
    times = [t for t, _ in runs]
    return statistics.median(times), min(times), max(times), runs[0][1]


def table(results: dict, cases: list[str], modes: list[str]) -> str:
    """Markdown table: s/step (range over repeats) and ratio to bf16 per mode, the aim, compiled - eager
    final loss."""
    head = (
        ["recipe"]
        + [f"{m} s/step | {m} vs bf16" for m in modes]
        + ["aim (compiled)", "loss compiled - eager"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * (len(modes) * 2 + 3)]
    for c in cases:
        cells = [c]
        for m in modes:
            t, lo, hi, _ = results[(c, m)]
            base = results[("bf16", m)][0]
            cells += [f"{t:.3f}" + (f" ({lo:.3f}-{hi:.3f})" if hi > lo else ""), f"{t / base:.2f}x"]
        a = aim(c)
        cells.append(f"<= {a}x" if a else "-")
        both = all((c, m) in results for m in ("eager", "compiled"))
        d = results[(c, "compiled")][3] - results[(c, "eager")][3] if both else float("nan")
        cells.append(f"{d:+.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", nargs="*", default=[*RECIPES, *TORCHAO_CASES])
    p.add_argument("--modes", nargs="*", default=["eager", "compiled"], choices=["eager", "compiled"])
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--skip", type=int, default=4, help="steps left out (compilation, warm-up)")
    p.add_argument("--repeats", type=int, default=1, help="runs per case, in interleaved rounds")
    p.add_argument("--out", default=None, help="folder for the runs (default: a temp folder)")
    a = p.parse_args()
    cases = ["bf16", *[r for r in a.recipes if r != "bf16"]]
    unknown = [c for c in cases if c not in RECIPES and c not in TORCHAO_CASES]
    if unknown:
        print(
            f"bench_train: --recipes {unknown[0]!r}: expected one of {', '.join([*RECIPES, *TORCHAO_CASES])}"
        )
        return 2
    out = Path(a.out or tempfile.mkdtemp(prefix="bench_train_"))
    runs: dict[tuple[str, str], list[tuple[float, float]]] = {(c, m): [] for c in cases for m in a.modes}
    for r in range(a.repeats):
        for c in cases:
            for m in a.modes:
                t, loss = run_case(out / f"round{r}", c, m, a)
                runs[(c, m)].append((t, loss))
                print(f"  round {r}: {c} {m}: {t:.3f} s/step, final loss {loss:.4f}", flush=True)
    results = {k: summary(v) for k, v in runs.items()}
    print(
        f"\ndebug model, 1 CPU rank, batch 4 x 256, {a.steps} steps (median after {a.skip}), "
        f"{a.repeats} run(s) per case (median; range in brackets); runs in {out}\n{machine_line()}\n"
    )
    print(table(results, cases, a.modes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
