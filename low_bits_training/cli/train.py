"""``lbt-train``: the training command on PATH, and what ``run_llama_train.sh`` and the slurm batch script run:
the launcher (``titan/launch/launcher.py``) with the speed model's word before a GPU run.

    lbt-train --config-file train_configs/debug_model.toml --training.steps 4      # one process
    lbt-train --nproc_per_node 2 --standalone -- --config-file train_configs/debug_model.toml

The whole config is checked in this process first (bad input: one line, exit code 2, nothing written to the run
folder), then torchrun starts the ranks in the same process; arguments before ``--`` are torchrun's, after it
(or all of them, without ``--``) training arguments. Exit codes: ``run/exits.py``. On a GPU where the
plan emulates GEMMs (no kernel for them there), one line before any rank starts says how much and the step
predicted against bf16's (``cli.speed.run_notes``).
"""

import sys

from low_bits_training.cli.speed import run_notes
from low_bits_training.titan.launch import launcher


def main(argv: list[str] | None = None) -> int:
    """``launcher.main`` with ``run_notes``."""
    return launcher.main(argv, notes=run_notes)


if __name__ == "__main__":
    sys.exit(main())
