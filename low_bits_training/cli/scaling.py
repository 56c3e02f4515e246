"""``lbt-scaling``: the same config at 1, 2, ... processes; tokens/s per process and in total.

    lbt-scaling --config-file train_configs/debug_model.toml --nproc 1,2 -- --training.steps 10
    lbt-scaling --config-file x.toml --nproc 1,2,4,8 --slurm --nnodes 1     # on a cluster, then --collect

The local batch per process stays fixed, so the global batch grows with the processes (weak scaling, as
FSDP's default ``data_parallel_shard_degree = -1`` does): perfect scaling keeps tokens/s per process flat and
multiplies the total. Runs go to ``<out>/<name>/nproc-N``; the table to ``<out>/<name>/scaling.md``.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from low_bits_training.cli.grid import NPROC, Grid, parse_value
from low_bits_training.cli.summary import RunStats, final_step, markdown, run_stats, write_csv
from low_bits_training.cli.sweep import run_points
from low_bits_training.run.exits import ExitCode
from low_bits_training.titan.platform import noise

SUPERLINEAR = 1.2  # efficiency above this is a measurement problem, not a speedup
HEADER = (
    "processes", "tok/s/proc", "tok/s total", "speedup", "efficiency", "final step", "final loss", "peak GiB/proc",
)  # fmt: skip


def scaling_cells(stats: dict[int, RunStats | None]) -> list[tuple[str, ...]]:
    """One row per process count; speedup and efficiency against the smallest count that ran."""
    done = {n: s for n, s in sorted(stats.items()) if s is not None and not math.isnan(s.tps)}
    ref = next(iter(done.items()), None)
    cells = []
    for n, s in sorted(stats.items()):
        if n not in done:
            cells.append((str(n), *("-" for _ in HEADER[1:])))
            continue
        total = s.tps * n
        speedup = total / (ref[1].tps * ref[0])
        cells.append(
            (
                str(n),
                f"{s.tps:.0f}",
                f"{total:.0f}",
                f"{speedup:.2f}x",
                f"{speedup / (n / ref[0]):.0%}",
                final_step([s]),
                f"{s.final:.4f}",
                f"{s.peak_gib:.2f}",
            )
        )
    return cells


def verdict(stats: dict[int, RunStats | None]) -> str:
    """One line: did more processes make training faster?"""
    done = {n: s.tps * n for n, s in sorted(stats.items()) if s is not None and not math.isnan(s.tps)}
    if len(done) < 2:
        return "fewer than two process counts finished: no comparison"
    (n0, t0), (n1, t1) = min(done.items()), max(done.items())
    faster = "faster" if t1 > t0 else "NOT faster"
    efficiency = t1 / t0 / (n1 / n0)
    line = (
        f"{n1} processes: {t1 / t0:.2f}x the total tokens/s of {n0} ({efficiency:.0%} scaling "
        f"efficiency): more processes made training {faster}"
    )
    if efficiency > SUPERLINEAR:  # weak scaling cannot beat linear by much: something else slowed a run
        line += (
            "; superlinear: other load on the machine likely slowed the smaller run, rerun when it is idle"
        )
    return line


def report(grid: Grid, out: Path) -> str:
    """Write ``scaling.md`` / ``scaling.csv`` into ``out``; return the table and the verdict."""
    stats = {p.nproc: run_stats(out / p.name) for p in grid.points()}
    cells = scaling_cells(stats)
    text = markdown(cells, HEADER) + "\n" + verdict(stats) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.md").write_text(
        f"# Scaling: {grid.config_file}\n\nOverrides: `{' '.join(grid.args)}`\n\n{text}"
    )
    write_csv(out / "scaling.csv", cells, HEADER)
    return text


def main(argv: list[str] | None = None) -> int:
    noise.install()  # upstream lines no user can act on (titan/platform/noise.py)
    parser = argparse.ArgumentParser(
        prog="lbt-scaling",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
        allow_abbrev=False,
    )
    parser.add_argument("--config-file", required=True, help="the TOML to scale")
    parser.add_argument("--nproc", default="1,2", help="process counts, comma-separated (default 1,2)")
    parser.add_argument("--name", default="scaling", help="folder name under --out")
    parser.add_argument("--out", default="outputs/sweeps", help="parent folder")
    parser.add_argument(
        "--slurm", action="store_true", help="submit each count with submit.sh (NGPU = count)"
    )
    parser.add_argument("--nnodes", type=int, default=1, help="nodes per run (with --slurm)")
    parser.add_argument("--collect", action="store_true", help="do not run: table of existing runs")
    ns, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    counts = [parse_value(v) for v in ns.nproc.split(",")]
    if not all(isinstance(n, int) and n > 0 for n in counts):
        print(f"lbt-scaling: --nproc = {ns.nproc!r}: expected positive integers, e.g. 1,2,4", file=sys.stderr)
        return ExitCode.CONFIG
    grid = Grid(
        config_file=ns.config_file,
        name=ns.name,
        grid={NPROC: counts},
        args=tuple(a for a in rest if a != "--"),
    )
    out = Path(ns.out) / grid.name
    if not ns.collect:
        failed = sum(r.returncode != 0 for r in run_points(grid, out, ns.slurm, ns.nnodes))
        if ns.slurm:
            print("submitted; when the jobs finish, rerun with --collect")
            return ExitCode.CRASH if failed else ExitCode.OK
    print(report(grid, out))
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
