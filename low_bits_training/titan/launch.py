"""The training entry point: ``python -m low_bits_training.titan.launch --config-file x.toml [--a.b value ...]``.

What ``torchtitan.train.main`` does, plus: CPU adapters first (before any other torchtitan import), the TOML
layer, the project's datasets, and the resolved config saved in the run folder. Bad configuration ends here
with one line on stderr and exit code 2, before any model is built.
"""

from __future__ import annotations

import os
import sys

from low_bits_training.titan import cpu


def split_config_file(argv: list[str]) -> tuple[str | None, list[str]]:
    """Take ``--config-file PATH`` (or ``--config-file=PATH``) out of argv; fall back to ``$CONFIG_FILE``."""
    rest, path, i = [], os.environ.get("CONFIG_FILE") or None, 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--config-file="):
            path = a.split("=", 1)[1]
        elif a == "--config-file" and i + 1 < len(argv):
            path, i = argv[i + 1], i + 1
        else:
            rest.append(a)
        i += 1
    return path, rest


def cpu_defaults(config) -> None:
    """Defaults that only make sense without an accelerator (base < these < TOML < CLI)."""
    config.training.disable_cuda_graphs = True  # no CUDA graphs on CPU; torchtitan refuses PP without this


def build_config(argv: list[str]):
    """Resolve the full config from argv (see ``split_config_file``) and prepare its data.

    Raises:
        ConfigError: one line, before any model is built.
    """
    from low_bits_training.config.tree import ConfigError
    from low_bits_training.titan import datasets
    from low_bits_training.titan.configure import load_config
    from low_bits_training.titan.optim import adapt_optimizer_config
    from low_bits_training.titan.quantize import apply_precision_plan

    config_file, rest = split_config_file(argv)
    on_cpu = cpu.needs_cpu_adapters()
    config = load_config(config_file, rest, platform_defaults=cpu_defaults if on_cpu else None)
    try:
        config.__post_init__()  # torchtitan's own cross-field checks, after the TOML was applied
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    adapt_optimizer_config(config)  # low-bit / torchao optimizer names: checked kwargs, our container
    apply_precision_plan(config)  # validate [quantize] and swap in QuantLinear configs, before any build
    datasets.register()
    datasets.prepare_assets(config)
    if on_cpu:
        cpu.adapt_trainer_config(config)
    return config


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def run(config) -> None:
    """Build the trainer and train; close it whatever happens (as torchtitan.train.main does)."""
    import torch
    from torchtitan.tools.logging import logger

    trainer = None
    try:
        trainer = config.build()
        if config.checkpoint.create_seed_checkpoint:
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    logger.info("Training finished")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if cpu.needs_cpu_adapters():
        cpu.install_device_module()
    from torchtitan.tools.logging import init_logger, logger

    from low_bits_training.config.tree import ConfigError
    from low_bits_training.titan.configure import save_resolved
    from low_bits_training.titan.numerics import exit_on_nonfinite
    from low_bits_training.titan.quantize import save_plan

    init_logger()
    try:
        config = build_config(argv)
    except ConfigError as e:
        print(f"low-bits-training: config error: {e}", file=sys.stderr)
        return 2
    if _is_rank0():
        path = save_resolved(config, config.dump_folder, [sys.argv[0], *argv])
        logger.info(f"Resolved config written to {path}")
        save_plan(config, config.dump_folder)  # precision_plan.txt/.json, and the table in the log
    return exit_on_nonfinite(run, config)  # [numerics] nonfinite = "stop": one line, exit code 3


if __name__ == "__main__":
    sys.exit(main())
