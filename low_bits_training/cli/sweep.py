"""``lbt-sweep``: one base config over a grid of overrides, then one comparison table and one loss plot.

    lbt-sweep --grid-file sweeps/precision.toml                    # run every point here, one after another
    lbt-sweep --config-file train_configs/debug_model.toml --name seeds \\
        --grid debug.seed=0,1 --grid training.steps=4 -- --training.local_batch_size 2
    lbt-sweep --grid-file sweeps/precision.toml --slurm            # submit every point with submit.sh
    lbt-sweep --grid-file sweeps/precision.toml --collect          # later: only the table and plot

Runs go to ``<out>/<name>/<point>`` (default out: outputs/sweeps); the table (``summary.md``, ``summary.csv``)
and ``loss.png`` go to ``<out>/<name>``. See ``low_bits_training.cli.grid`` for the grid file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from low_bits_training.cli import runner
from low_bits_training.cli.grid import NPROC, Grid, load_grid
from low_bits_training.cli.progress import SweepProgress
from low_bits_training.cli.summary import Row, markdown, plot_losses, run_stats, table_rows, write_csv
from low_bits_training.errors import ConfigError
from low_bits_training.run.exits import ExitCode
from low_bits_training.titan.platform import noise


def run_points(grid: Grid, out: Path, slurm: bool = False, nnodes: int = 1) -> list[runner.Result]:
    """Run (or submit) every point of the grid, one after another; a failed point does not stop the rest.

    Locally a progress display (point i/N, elapsed, time left, the running point's step and loss) follows
    the runs (``cli.progress``).
    """
    results = []
    points = grid.points()
    with SweepProgress(len(points)) as progress:
        for p in points:
            folder = out / p.name
            progress.start(p.name, folder, " ".join(p.args))
            if slurm:
                r = runner.submit(grid.config_file, folder, p.args, p.nproc, nnodes, wandb_group=grid.name)
            else:
                r = runner.run_local(grid.config_file, folder, p.args, p.nproc, watch=progress.poll)
            progress.finish(r.returncode)
            results.append(r)
    return results


def collect(grid: Grid, out: Path) -> tuple[list[Row], Row]:
    """The table rows (points grouped over seeds) and the baseline row.

    Raises:
        ValueError: the baseline values match no row.
    """
    groups: dict[tuple, Row] = {}
    for p in grid.points():
        key = grid.group_key(p)
        label = ", ".join(f"{k}={v}" for k, v in key if k != NPROC and len(grid.grid[k]) > 1) or "base"
        row = groups.setdefault(key, Row(label, p.nproc, {}))
        row.seeds[p.values.get(grid.seed_key, 0)] = run_stats(out / p.name)
    rows = list(groups.values())
    if not grid.baseline:
        return rows, rows[0]
    want = {(k, v) for k, v in grid.baseline.items()}
    for key, row in groups.items():
        if want <= set(key):
            return rows, row
    raise ValueError(f"baseline = {grid.baseline!r}: matches no grid point")


def report(grid: Grid, out: Path) -> str:
    """Write ``summary.md``, ``summary.csv`` and ``loss.png`` into ``out``; return the markdown table."""
    rows, baseline = collect(grid, out)
    cells = table_rows(rows, baseline)
    table = markdown(cells)
    out.mkdir(parents=True, exist_ok=True)
    title = f"Sweep {grid.name}: {grid.config_file}"
    (out / "summary.md").write_text(f"# {title}\n\nCommon overrides: `{' '.join(grid.args)}`\n\n{table}")
    write_csv(out / "summary.csv", cells)
    curves = {}
    for p in grid.points():
        stats = run_stats(out / p.name)
        if stats is not None:
            curves[p.name] = stats.losses
    plot_losses(out / "loss.png", curves, title)
    return table


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Options, and the training overrides after them (or after ``--``)."""
    parser = argparse.ArgumentParser(
        prog="lbt-sweep",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__,
        allow_abbrev=False,
    )
    parser.add_argument("--grid-file", help="TOML grid file (see low_bits_training.cli.grid)")
    parser.add_argument("--config-file", help="base TOML (overrides the grid file's config_file)")
    parser.add_argument("--name", help="sweep name (default: the grid file's, else 'sweep')")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="a grid axis")
    parser.add_argument("--baseline", action="append", default=[], metavar="KEY=V", help="the baseline row")
    parser.add_argument("--out", default="outputs/sweeps", help="parent of the sweep folder")
    parser.add_argument("--slurm", action="store_true", help="submit every point with submit.sh")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes per run (with --slurm)")
    parser.add_argument("--collect", action="store_true", help="do not run: table and plot of existing runs")
    ns, rest = parser.parse_known_args(argv)
    return ns, [a for a in rest if a != "--"]


def main(argv: list[str] | None = None) -> int:
    noise.install()  # upstream lines no user can act on (titan/platform/noise.py)

    ns, extra = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        grid = load_grid(ns.grid_file, ns.config_file, ns.name, ns.grid, ns.baseline, extra)
    except (ConfigError, OSError) as e:
        print(f"lbt-sweep: {e}", file=sys.stderr)
        return ExitCode.CONFIG
    out = Path(ns.out) / grid.name
    failed = 0
    if not ns.collect:
        failed = sum(r.returncode != 0 for r in run_points(grid, out, ns.slurm, ns.nnodes))
        if ns.slurm:
            print(f"submitted; when the jobs finish: lbt-sweep {' '.join(sys.argv[1:])} --collect")
            return ExitCode.CRASH if failed else ExitCode.OK
    print(report(grid, out))
    print(f"table: {out / 'summary.md'} ({out / 'summary.csv'}), plot: {out / 'loss.png'}")
    return ExitCode.CRASH if failed else ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
