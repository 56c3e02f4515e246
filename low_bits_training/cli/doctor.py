"""``lbt-doctor`` / ``python -m low_bits_training.cli.doctor [--config-file X.toml] [--recipe R ...] [overrides]``

Checks the environment before a long job: versions, GPUs, NCCL, whether each format runs with real kernels or
emulated, W&B, tokenizer and dataset, disk for checkpoints. Prints one table row per check (OK / WARN / FAIL
with a one-line fix) and exits 1 when anything FAILs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping

from low_bits_training.cli.checks import (
    Check,
    check_cuda,
    check_gpu_count,
    check_nccl,
    check_versions,
    check_wandb,
)


def run_checks(
    config_file: str | None, args: list[str], env: Mapping[str, str], recipes: list[str] | None = None
) -> list[Check]:
    """Every check, in the order a user fixes them.

    Args:
        config_file: the run's TOML (None: the environment checks and the base config).
        args: training overrides as the launcher takes them (``--quantize.recipe fp8_rowwise``).
        env: the environment to judge (``os.environ``).
        recipes: more recipe names to check (e.g. every recipe of a sweep).

    Returns:
        The checks.
    """
    from low_bits_training.cli.config_checks import config_checks

    checks = [*check_versions(), check_cuda(), check_nccl(), check_gpu_count(env)]
    more, wandb_asked = config_checks(config_file, args, dict(env), recipes or [])
    return [*checks, check_wandb(env, wandb_asked), *more]


def render(checks: list[Check]) -> str:
    """A markdown table: check | status | detail | fix."""
    rows = [("check", "status", "detail", "fix"), *((c.name, c.status, c.detail, c.fix) for c in checks)]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    line = lambda r: "| " + " | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join(
        [line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows[1:])]
    )


def exit_code(checks: list[Check]) -> int:
    """1 when any check FAILs, else 0 (WARNs do not stop a job)."""
    return 1 if any(c.status == "FAIL" for c in checks) else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lbt-doctor", description=__doc__.split("\n\n")[1], allow_abbrev=False
    )
    parser.add_argument("--config-file", default=os.environ.get("CONFIG_FILE"), help="the run's TOML")
    parser.add_argument("--recipe", action="append", default=[], help="also check this recipe (repeatable)")
    ns, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    checks = run_checks(ns.config_file, rest, os.environ, ns.recipe)
    print(render(checks))
    fails = sum(c.status == "FAIL" for c in checks)
    warns = sum(c.status == "WARN" for c in checks)
    print(f"\n{fails} FAIL, {warns} WARN, {len(checks) - fails - warns} OK")
    return exit_code(checks)


if __name__ == "__main__":
    sys.exit(main())
