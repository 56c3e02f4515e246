"""One training rank: ``python -m low_bits_training.titan.launch.worker --config-file x.toml [--a.b value
...]``.

torchrun starts one of these per rank (``run_llama_train.sh`` through ``titan/launch/launcher.py``, which has
checked the whole config before). What ``torchtitan.train.main`` does, plus: CPU adapters first (put in
by importing titan: ``titan/platform/stand.py``), the TOML layer, the project's datasets, and the run's own
files (resolved config, precision plan) written once the run has really started: after the checkpoint, if
any, was loaded.

A run that cannot go on ends in one line and an exit code that says why (``run/exits.py``: ``ExitCode``,
``ENDINGS``); under the launcher the line goes to torchrun's error file and the launcher prints it once,
whichever rank it came from.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torchtitan.tools.logging import init_logger, logger

from low_bits_training.config.argv import take_flag
from low_bits_training.errors import ConfigError
from low_bits_training.run.exits import ExitCode, classify
from low_bits_training.titan.launch import datasets
from low_bits_training.titan.launch.configure import load_config, save_resolved
from low_bits_training.titan.platform import cpu
from low_bits_training.titan.platform.devices import this_machine_refusal
from low_bits_training.titan.platform.ranks import is_rank0
from low_bits_training.titan.runtime.checkpoint import LowBitsCheckpointManager
from low_bits_training.titan.runtime.graphs import apply_graph_policy, graphs_off_before_check
from low_bits_training.titan.runtime.optim import adapt_optimizer_config
from low_bits_training.titan.targets.registry import apply_run, save_plan
from low_bits_training.titan.targets.torchao_backend import guard_torchao_modules

UNDER_LAUNCHER = "LBT_LAUNCHER"
"""Set (to 1) by the launcher for its ranks: report errors through torchrun's error file, not stderr."""


def split_config_file(argv: list[str]) -> tuple[str | None, list[str]]:
    """Take ``--config-file PATH`` (or ``--config-file=PATH``) out of argv; fall back to ``$CONFIG_FILE``."""
    path, rest = take_flag(argv, "config-file")
    return path or os.environ.get("CONFIG_FILE") or None, rest


def cpu_defaults(config) -> None:
    """Defaults that only make sense without an accelerator (base < these < TOML < CLI)."""
    config.training.disable_cuda_graphs = True  # no CUDA graphs on CPU; torchtitan refuses PP without this


def load_on_platform(config_file: str | None, rest: list[str], on_cpu: bool):
    """``configure.load_config`` with this platform's defaults, and CUDA graphs off for pipeline parallelism
    before torchtitan's own check refuses the two together (``graphs.graphs_off_before_check``).

    tyro runs that check as it reads the command line, before the config is ours to change: on a GPU node a
    refused read is read again with graphs off, and kept only where the policy turns them off for a pipeline
    (any other refusal stands: the second read's, else the first's).

    Raises:
        ConfigError: one line.
    """
    try:
        config = load_config(config_file, rest, platform_defaults=cpu_defaults if on_cpu else None)
    except ConfigError as refused:
        if on_cpu:
            raise
        config = load_config(config_file, rest, platform_defaults=graphs_off)
        if graphs_off_before_check(config, on_cpu) is None:
            raise refused from None
        return config
    graphs_off_before_check(config, on_cpu)
    return config


def graphs_off(config) -> None:
    """CUDA graphs off in the base (under the TOML and the command line), for ``load_on_platform``'s second read."""
    config.training.disable_cuda_graphs = True


def build_config(argv: list[str]):
    """Resolve the full config from argv (see ``split_config_file``) and prepare its data.

    Raises:
        ConfigError: one line, before any model is built.
    """
    config_file, rest = split_config_file(argv)
    on_cpu = cpu.needs_cpu_adapters()
    config = load_on_platform(config_file, rest, on_cpu)
    try:
        config.__post_init__()  # torchtitan's own cross-field checks, after the TOML was applied
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None
    adapt_optimizer_config(config)  # low-bit / torchao optimizer names: checked kwargs, our container
    # the run resolved once (titan/targets/registry.py); its targets converted, before any build
    apply_run(config)
    guard_torchao_modules(config.model_spec.model)  # torchao's fp8-store NaN guard, before any compile
    # CUDA graphs off where the run is not capturable (titan/runtime/graphs.py)
    apply_graph_policy(config, on_cpu)
    datasets.register()
    datasets.prepare_assets(config)
    if on_cpu:
        cpu.adapt_trainer_config(config)
    return config


def report(error: BaseException) -> ExitCode | None:
    """Say a known error in one line and return its exit code (None: not one of ``exits.ENDINGS``).

    Under the launcher the line goes to torchrun's per-rank error file (the launcher prints it once);
    otherwise rank 0 prints it to stderr.
    """
    known = classify(error)
    if known is None:
        return None
    code, line = known
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if os.environ.get(UNDER_LAUNCHER) == "1" and error_file:
        with open(error_file, "w") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    elif is_rank0():
        print(line, file=sys.stderr, flush=True)
    return code


def write_run_files(config, argv: list[str]) -> None:
    """The run has started: rank 0 writes the resolved config and the precision plan into the run folder."""
    if is_rank0():
        path = save_resolved(config, config.dump_folder, [sys.argv[0], *argv])
        logger.info(f"Resolved config written to {path}")
        save_plan(config, config.dump_folder)  # precision_plan.txt/.json, and the table in the log


def run(config, on_start) -> None:
    """Build the trainer, call ``on_start()`` once the checkpoint (if any) is loaded, and train; close the
    trainer whatever happens (as torchtitan.train.main does)."""
    trainer = None
    try:
        trainer = config.build()
        ckpt = trainer.checkpointer
        if isinstance(ckpt, LowBitsCheckpointManager) and ckpt.enable:
            ckpt.on_start = on_start  # called by its load, which train() starts with
        else:
            on_start()  # nothing to load: the run starts here
        if config.checkpoint.create_seed_checkpoint:
            trainer.checkpointer.save(curr_step=0, last_step=True)
        else:
            trainer.train()
        remove_empty_comm_traces(config)
    finally:
        if trainer is not None:
            trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    logger.info("Training finished")


def remove_empty_comm_traces(config) -> None:
    """After a run that ended well, rank 0 removes ``<dump_folder>/comm_traces`` if it is empty.

    torchtitan makes that folder at every start for NCCL's flight recorder (``comm.save_traces_folder``,
    distributed/utils.py ``init_distributed``), which writes into it only when a collective times out.
    """
    folder = os.path.join(config.dump_folder, config.comm.save_traces_folder)
    if is_rank0() and os.path.isdir(folder) and not os.listdir(folder):
        os.rmdir(folder)


def refuse_this_machine() -> None:
    """A rank started without the launcher (torchrun directly) is refused where the launcher refuses every
    run: an NVIDIA driver and no GPU torch can see (``devices.this_machine_refusal``).

    Raises:
        ConfigError: the refusal, one line.
    """
    why = this_machine_refusal()
    if why:
        raise ConfigError(why)


def main(argv: list[str] | None = None) -> int:
    """One rank: resolve the config, train; a known error is one line and its exit code (``exits.ENDINGS``)."""
    argv = sys.argv[1:] if argv is None else argv
    init_logger()  # the noise filters and the CPU adapters went in when titan was imported (platform/stand.py)
    try:
        refuse_this_machine()
        config = build_config(argv)
        run(config, on_start=lambda: write_run_files(config, argv))
    except Exception as e:
        code = report(e)
        if code is None:
            raise  # a crash: its traceback is what the user needs (ExitCode.CRASH, from Python)
        return code
    return ExitCode.OK


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    # a crash's traceback also goes to torchrun's error file: the launcher shows it where LOG_RANK hides it
    sys.exit(record(main)())
