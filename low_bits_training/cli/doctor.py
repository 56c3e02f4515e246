"""``lbt-doctor`` / ``python -m low_bits_training.cli.doctor [--config-file X.toml] [--recipe R ...] [overrides]``

Checks the environment before a long job: versions, GPUs, NCCL, W&B, then the run itself as the launcher would
start it: its config, which backend runs each linear layer here (or on ``--hardware``), torch.compile, data,
tokenizer, disk for checkpoints. Prints one table row per check (OK / WARN / FAIL with a one-line fix) and exits
with ``ExitCode.CONFIG`` (2) when anything FAILs (the job would be refused or break before it trains), else 0.
Without ``--config-file`` it checks the run ``./run_llama_train.sh`` starts by default.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path

from low_bits_training.cli.checks import (
    Check,
    check_cuda,
    check_gpu_count,
    check_nccl,
    check_versions,
    check_wandb,
)
from low_bits_training.cli.config_checks import config_checks, fit_report
from low_bits_training.cli.runner import repo_root
from low_bits_training.cli.speed import check_speed
from low_bits_training.nn.hardware import Hardware, detect_hardware
from low_bits_training.run.exits import ExitCode
from low_bits_training.speed.gpus import GPUS, gpu
from low_bits_training.titan.platform import noise

DEFAULT_CONFIG_FILE = "train_configs/debug_model.toml"
"""``run_llama_train.sh``'s ``CONFIG_FILE`` default (a test holds the two equal)."""
HARDWARE = {
    "cpu": (None, "cpu"),
    "sm89": ((8, 9), "cuda"),
    "sm90": ((9, 0), "cuda"),
    "sm100": ((10, 0), "cuda"),
}
"""``--hardware``'s architectures; it also takes a GPU the speed model knows (``h100``: ``speed.gpus.GPUS``)."""


def default_config_file(env: Mapping[str, str]) -> str:
    """``$CONFIG_FILE``, else the launcher's default, found from here or from the repository this package is in."""
    if env.get("CONFIG_FILE"):
        return env["CONFIG_FILE"]
    here = Path(DEFAULT_CONFIG_FILE)
    repo = repo_root() / DEFAULT_CONFIG_FILE
    return str(here if here.is_file() or not repo.is_file() else repo)


def hardware(name: str | None) -> Hardware:
    """This machine's hardware, or the one ``--hardware`` names (torchao availability is this machine's)."""
    here = detect_hardware()
    if name is None:
        return here
    if name not in HARDWARE:
        return gpu(name).hardware(here.torchao)  # its architecture, and its speed row that GPU's
    capability, kind = HARDWARE[name]
    return Hardware(kind, capability, here.torchao)


def run_checks(
    config_file: str | None,
    args: list[str],
    env: Mapping[str, str],
    recipes: list[str] | None = None,
    hw: Hardware | None = None,
) -> list[Check]:
    """Every check, in the order a user fixes them.

    Args:
        config_file: the run's TOML (None: ``default_config_file(env)``).
        args: training overrides as the launcher takes them (``--quantize.recipe fp8_rowwise``).
        env: the environment to judge (``os.environ``).
        recipes: more recipe names to judge on the same model (e.g. every recipe of a sweep).
        hw: the hardware to judge the plan on (default: this machine's). Named hardware is judged as the
            launcher's ``--check-only`` judges a run for GPUs elsewhere: no accelerator or memory check against
            this machine (``memory.limit_gib`` still holds the plan).

    Returns:
        The checks.
    """
    checks = [*check_versions(), check_cuda(), check_nccl(), check_gpu_count(env)]
    elsewhere = hw is not None  # judged as on named hardware: the run's memory is not held to this machine
    hw = hw or detect_hardware()
    more, wandb_asked = config_checks(
        config_file or default_config_file(env),
        args,
        dict(env),
        recipes or [],
        hw,
        (check_speed,),
        not elsewhere,
    )
    return [*checks, check_wandb(env, wandb_asked), *more]


def render(checks: list[Check]) -> str:
    """A markdown table: check | status | detail | fix."""
    rows = [("check", "status", "detail", "fix"), *((c.name, c.status, c.detail, c.fix) for c in checks)]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    line = lambda r: "| " + " | ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join(
        [line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows[1:])]
    )


def exit_code(checks: list[Check]) -> ExitCode:
    """``ExitCode.CONFIG`` when any check FAILs (as the launcher refuses a job before any rank starts; 1 stays
    a crash of doctor itself), else ``ExitCode.OK`` (WARNs do not stop a job)."""
    return ExitCode.CONFIG if any(c.status == "FAIL" for c in checks) else ExitCode.OK


def main(argv: list[str] | None = None) -> ExitCode:
    noise.install()  # upstream lines no user can act on: torchtitan warns once per config checked here
    parser = argparse.ArgumentParser(
        prog="lbt-doctor", description=__doc__.split("\n\n")[1], allow_abbrev=False
    )
    parser.add_argument(
        "--config-file", default=None, help=f"the run's TOML (default: $CONFIG_FILE or {DEFAULT_CONFIG_FILE})"
    )
    parser.add_argument("--recipe", action="append", default=[], help="also judge this recipe (repeatable)")
    parser.add_argument(
        "--hardware",
        choices=sorted([*HARDWARE, *(name.lower() for name in GPUS)]),
        default=None,
        help="judge the plan as on this GPU: an architecture (sm90) or a GPU the speed model knows (h100) "
        "(default: this machine)",
    )
    parser.add_argument(
        "--fit",
        action="store_true",
        help="plan the run's peak memory with each change that lowers it (activation checkpointing, a smaller "
        "local batch) and print them ranked against the limit (--memory.limit_gib, or this machine's free memory)",
    )
    ns, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    repo = repo_root()
    if (
        ns.config_file is None
        and not os.environ.get("CONFIG_FILE")
        and (repo / "run_llama_train.sh").is_file()
    ):
        os.chdir(repo)  # as run_llama_train.sh does: the default run's relative paths are the repository's
    hw = hardware(ns.hardware) if ns.hardware else None
    checks = run_checks(ns.config_file, rest, os.environ, ns.recipe, hw)
    print(render(checks))
    fails = sum(c.status == "FAIL" for c in checks)
    warns = sum(c.status == "WARN" for c in checks)
    print(f"\n{fails} FAIL, {warns} WARN, {len(checks) - fails - warns} OK")
    if ns.fit:
        print("\n" + fit_report(ns.config_file or default_config_file(os.environ), rest, os.environ))
    return exit_code(checks)


if __name__ == "__main__":
    sys.exit(main())
