"""``lbt-train``: the training command on PATH, the launcher ``run_llama_train.sh`` runs
(``titan/launch/launcher.py``).

    lbt-train --config-file train_configs/debug_model.toml --training.steps 4      # one process
    lbt-train --nproc_per_node 2 --standalone -- --config-file train_configs/debug_model.toml

The whole config is checked in this process first (bad input: one line, exit code 2, nothing written to the run
folder), then torchrun starts the ranks in the same process; arguments before ``--`` are torchrun's, after it
(or all of them, without ``--``) training arguments. Exit codes: ``config/exits.py``.
"""

import sys

from low_bits_training.titan.launch.launcher import main

if __name__ == "__main__":
    sys.exit(main())
