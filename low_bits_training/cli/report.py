"""``lbt-report RUN_DIR [RUN_DIR ...] -o OUT``: loss / throughput / memory curves, numerics heatmaps, one HTML.

Equivalent: ``python -m low_bits_training.cli.report RUN_DIR ... -o OUT``. See docs/numerics.md.
"""

from __future__ import annotations

import argparse
import sys

from low_bits_training.report import build_report
from low_bits_training.run.exits import ExitCode
from low_bits_training.titan.platform import noise


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and build the report; a missing run folder is one line and exit code 2."""
    noise.install()  # upstream lines no user can act on (titan/platform/noise.py)
    p = argparse.ArgumentParser(prog="lbt-report", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", help="run folders (each a training's dump_folder)")
    p.add_argument("-o", "--out", default="report", help="output folder for the PNGs and report.html")
    args = p.parse_args(argv)

    try:
        page = build_report(args.runs, args.out)
    except FileNotFoundError as e:
        print(f"lbt-report: {e}", file=sys.stderr)
        return ExitCode.CONFIG
    print(page)
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
