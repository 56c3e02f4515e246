"""``lbt-train``: the training entry point on PATH (the same as ``python -m low_bits_training.titan.launch``).

Run it under torchrun (``run_llama_train.sh`` does): ``torchrun --nproc_per_node 2 -m low_bits_training.cli.train
--config-file train_configs/debug_model.toml``.
"""

import sys

from low_bits_training.titan.launch import main

if __name__ == "__main__":
    sys.exit(main())
