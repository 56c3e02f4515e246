"""The NVFP4 recipe's parts, one at a time: loss gap to bf16 (same seed) with its spread over seeds, on CPU.

Reproduces the ablation of NVIDIA's NVFP4 pretraining paper (arXiv 2509.25149 sec. 4-5) at toy scale: bf16,
the full ``nvfp4`` recipe (RHT 16 on the weight-gradient GEMM, 16x16 weight tiles, stochastic rounding of
gradients), each of ``nvfp4_no_rht`` / ``nvfp4_no_sr`` / ``nvfp4_1d_weights`` (one part off) and ``mxfp4``.
Every run goes through ``run_llama_train.sh`` (the sweep's runner and grid, ``cli.sweep``) on the built-in
Markov corpus; runs of one seed share the initialisation and the batches, so the gap to bf16 is paired.

    flock /tmp/lbt-heavy.lock .venv/bin/python benchmarks/nvfp4_ablation.py            # ~25 min, 2 cores
    .venv/bin/python benchmarks/nvfp4_ablation.py --collect                            # table + plot only
    .venv/bin/python benchmarks/nvfp4_ablation.py --steps 20 --seeds 0 --recipes bf16,nvfp4   # a smoke run

Writes ``<out>/summary.md``, ``summary.csv`` and the plot (``<out>/nvfp4_ablation.png`` unless ``--plot``
names another file: ``--plot docs/img/nvfp4_ablation.png`` refreshes the committed figure on purpose); prints
the table. With no finished run it says so and writes nothing (exit code 1). "gap" columns: recipe loss - bf16 loss of the same seed, at the last step and averaged over the
last ``--window`` steps (one step's loss is one batch's; the window average is the steadier number).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from low_bits_training.cli import runner
from low_bits_training.cli.grid import Grid
from low_bits_training.cli.summary import markdown, mean_std, run_stats, write_csv

RECIPES = ("bf16", "nvfp4", "nvfp4_no_rht", "nvfp4_no_sr", "nvfp4_1d_weights", "mxfp4")
BASE = "low_bits_training.titan.launch.bases:llama3_narrow"
"""The debug model at width 128 with 2 blocks (vocab 2048). The emulated NVFP4 step is dominated by per-cast
overhead (random bits, Hadamard butterflies, six casts per layer), not by the GEMMs: ~0.5-1.4 s per step on one
thread, ~5x the bf16 step."""
HEADER = ("recipe", "runs", "final loss", "gap final", "gap last {window} steps", "tok/s/proc")
"""Table columns (``window`` filled in); "runs": finished runs / seeds."""


def make_grid(a: argparse.Namespace) -> Grid:
    """The sweep grid: recipe x seed over the debug config at the ablation's shape."""
    args = (
        "--job.base", a.base, "--training.steps", str(a.steps), "--training.local_batch_size", str(a.batch),
        "--training.seq_len", str(a.seq_len), "--lr_scheduler.warmup_steps", str(max(1, a.steps // 20)),
        "--checkpoint.no-enable", "--metrics.log_freq", "1", "--metrics.no-enable-tensorboard",
    ) + (("--compile.enable",) if a.compile else ())  # fmt: skip
    return Grid(
        config_file=str(runner.REPO / "train_configs" / "debug_model.toml"),
        name="nvfp4_ablation",
        grid={"quantize.recipe": list(a.recipes), "debug.seed": list(a.seeds)},
        args=args,
        baseline={"quantize.recipe": "bf16"},
    )


def run_all(grid: Grid, out: Path, jobs: int, steps: int) -> int:
    """Train every point that has not finished yet (a rerun resumes the study; a point whose log was written
    in the last 2 minutes is left to the invocation training it), ``jobs`` at a time (one thread each when
    parallel); returns the failures."""
    if jobs > 1:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))

    def one(p):
        done = run_stats(out / p.name)
        if done is not None and max(done.losses, default=0) >= steps:
            return 0
        log = out / p.name / "train.log"
        if log.is_file() and time.time() - log.stat().st_mtime < 120:  # another invocation is training it
            print(f"  {p.name}: running elsewhere, left to it", file=sys.stderr, flush=True)
            return 0
        r = runner.run_local(grid.config_file, out / p.name, p.args, p.nproc)
        print(f"  {p.name}: exit {r.returncode}", file=sys.stderr, flush=True)
        return r.returncode

    with ThreadPoolExecutor(jobs) as pool:
        return sum(rc != 0 for rc in pool.map(one, grid.points()))


def losses(grid: Grid, out: Path, steps: int) -> dict[str, dict[int, dict[int, float]]]:
    """recipe -> seed -> step -> loss, for the runs that reached ``steps``."""
    got: dict[str, dict[int, dict[int, float]]] = {}
    for p in grid.points():
        stats = run_stats(out / p.name)
        if stats is not None and max(stats.losses, default=0) >= steps:
            got.setdefault(p.values["quantize.recipe"], {})[p.values["debug.seed"]] = stats.losses
    return got


def gaps(runs: dict[int, dict[int, float]], base: dict[int, dict[int, float]]) -> dict[int, dict[int, float]]:
    """seed -> step -> recipe loss - bf16 loss, over the seeds and steps both have."""
    return {s: {t: runs[s][t] - base[s][t] for t in runs[s] if t in base[s]} for s in runs if s in base}


def window_mean(curve: dict[int, float], window: int) -> float:
    """Mean of the last ``window`` steps of a step -> value curve."""
    last = sorted(curve)[-window:]
    return statistics.fmean(curve[t] for t in last)


def fmt(m: float, s: float) -> str:
    return "-" if m != m else f"{m:+.4f} ± {s:.4f}"


def table(grid: Grid, out: Path, window: int, steps: int) -> list[tuple[str, ...]]:
    """One row per recipe (finished runs): final loss, the paired gaps to bf16 (mean ± std over seeds), tok/s."""
    curves = losses(grid, out, steps)
    base = curves.get("bf16", {})
    cells = []
    for recipe in grid.grid["quantize.recipe"]:
        runs = curves.get(recipe, {})
        finals = [c[max(c)] for c in runs.values()]
        g = gaps(runs, base)
        tps = [s.tps for p in grid.points() if p.values["quantize.recipe"] == recipe
               if (s := run_stats(out / p.name)) is not None]  # fmt: skip
        m, sd = mean_std(finals)
        cells.append(
            (
                recipe,
                f"{len(runs)}/{len(grid.grid['debug.seed'])}",
                "-" if m != m else f"{m:.4f} ± {sd:.4f}",
                fmt(*mean_std([c[max(c)] for c in g.values() if c])),
                fmt(*mean_std([window_mean(c, window) for c in g.values() if c])),
                f"{statistics.fmean(tps):.0f}" if tps else "-",
            )
        )
    return cells


def smooth(ys: list[float], k: int) -> list[float]:
    """Trailing moving average over ``k`` points (fewer at the start)."""
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y - (ys[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out


def plot(grid: Grid, out: Path, path: Path, window: int, steps: int) -> None:
    """Gap to bf16 per step (moving average over ``window``): seed mean as a line, min..max over seeds shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = losses(grid, out, steps)
    base = curves.get("bf16", {})
    fig, ax = plt.subplots(figsize=(8, 5))
    for recipe in grid.grid["quantize.recipe"]:
        g = gaps(curves.get(recipe, {}), base)
        if recipe == "bf16" or not g:
            continue
        steps = sorted(set.intersection(*(set(c) for c in g.values())))
        per_seed = [smooth([c[t] for t in steps], window) for c in g.values()]
        mean = [statistics.fmean(v) for v in zip(*per_seed, strict=True)]
        (line,) = ax.plot(steps, mean, label=f"{recipe} ({len(per_seed)} seeds)")
        lo = [min(v) for v in zip(*per_seed, strict=True)]
        hi = [max(v) for v in zip(*per_seed, strict=True)]
        ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.2)
    ax.axhline(0.0, color="black", lw=0.8)
    ax.set(xlabel="step", ylabel=f"loss - bf16 loss (same seed; {window}-step moving average)",
           title="NVFP4 ablation: gap to bf16 (line: seed mean, band: seed min..max)")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipes", type=lambda s: s.split(","), default=list(RECIPES), help="comma list")
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--base", default=BASE, help="job.base: the model")
    p.add_argument("--compile", action="store_true", help="train with --compile.enable")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time (threads: cores / jobs each)")
    p.add_argument("--window", type=int, default=40, help="steps averaged for the gap column and the plot")
    p.add_argument("--out", default="outputs/sweeps/nvfp4_ablation", help="run folders and the tables")
    p.add_argument("--plot", help="the plot's file (default: <out>/nvfp4_ablation.png)")
    p.add_argument("--collect", action="store_true", help="do not train: table and plot of existing runs")
    a = p.parse_args(argv)
    if "bf16" not in a.recipes:
        p.error("--recipes: must include bf16 (the baseline of every gap)")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    grid, out = make_grid(a), Path(a.out)
    plot_path = Path(a.plot) if a.plot else out / "nvfp4_ablation.png"
    failed = 0 if a.collect else run_all(grid, out, a.jobs, a.steps)
    if not losses(grid, out, a.steps):  # an empty table and plot would replace a real one for nothing
        print(f"nvfp4_ablation: no run under {out} reached step {a.steps}: nothing to tabulate or plot",
              file=sys.stderr)  # fmt: skip
        return 1
    cells = table(grid, out, a.window, a.steps)
    header = tuple(h.format(window=a.window) for h in HEADER)
    md = markdown(cells, header)
    out.mkdir(parents=True, exist_ok=True)
    mode = "compiled" if a.compile else "eager"
    shape = f"{a.base}, {a.steps} steps, batch {a.batch} x {a.seq_len}, seeds {a.seeds}, {mode}"
    (out / "summary.md").write_text(f"# NVFP4 ablation ({shape})\n\n{md}")
    write_csv(out / "summary.csv", cells, header)
    plot(grid, out, plot_path, a.window, a.steps)
    print(f"{shape}; gap = recipe - bf16 (same seed), mean ± std over seeds\n\n{md}")
    print(f"table: {out / 'summary.md'} ({out / 'summary.csv'}), plot: {plot_path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
