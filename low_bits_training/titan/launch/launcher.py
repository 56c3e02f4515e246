"""The launcher: torchrun with the whole config checked first, and one line and a meaningful exit code last.

    python -m low_bits_training.titan.launch.launcher [torchrun options] -- [training arguments]
    python -m low_bits_training.titan.launch.launcher --check-only [torchrun options] -- [training arguments]

``run_llama_train.sh``, ``scripts/slurm/train.sbatch`` and ``lbt-sweep`` / ``lbt-scaling`` start training
through it. In this process, before any rank starts:

- the config is resolved exactly as each rank will resolve it (``worker.build_config``) and checked as a whole
  (``validate.check_run``: value ranges, parallel degrees against NGPU x nodes, the model's own checks, the
  checkpoint it would resume from); a machine with an NVIDIA driver on which torch sees no GPU, several CPU
  ranks of a large model (``accelerator_refusal``) and more processes per node than visible GPUs
  (``check_gpu_count``) are refused. Bad input is one line, exit code 2 (4 for a checkpoint), no
  traceback, and nothing is written to the run folder;
- then torchrun runs in this same process (no second interpreter start). Without an accelerator and
  without torch.compile each rank is a fork of this process, whose imports are done (``start_method``: a
  1-step debug run, 35.0 s -> 21.4 s wall, 29.2 s -> 19.1 s CPU on a 2-core machine); otherwise each rank is
  a fresh interpreter, as torchrun starts it. A rank that ends on purpose
  (``run/exits.py``: 3 for a non-finite stop, 4 for a checkpoint refused at load) leaves its one line in
  torchrun's error file; it is printed here once, and this process exits with that rank's code. A crash keeps
  its traceback (from the rank, or from its error file where LOG_RANK hides that rank: ``crash_report``) and
  ends with exit code 1.

``--check-only`` stops after the check (``submit.sh`` checks a job this way before it submits it, on a login
node: this machine's accelerator is not judged, the ranks will run elsewhere). A run
whose checkpoint already reached ``training.steps`` says so in one line and ends with 0 before torchrun
starts. Under pipeline parallelism the console shows the rank that has the loss (``show_the_loss``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.run import determine_local_world_size

from low_bits_training.errors import ConfigError
from low_bits_training.run.exits import ExitCode, classify
from low_bits_training.titan.launch.memory import check_peak, peak_check_of
from low_bits_training.titan.launch.torchrun import (
    run_torchrun,
    show_the_loss,
    start_method,
    torchrun_args,
    world_size,
)
from low_bits_training.titan.launch.validate import check_run
from low_bits_training.titan.launch.worker import build_config
from low_bits_training.titan.platform import cpu
from low_bits_training.titan.platform.devices import (
    ALLOW_CPU_RANKS,
    cuda_refusal,
    gpu_count_refusal,
    nvidia_driver,
)

CPU_RANKS_PARAMS = 1_000_000_000
"""The largest model (parameters) started as several CPU ranks without a word: the debug models (6M) and
small research models train that way (README); an 8B model on 8 gloo ranks is a GPU node gone wrong."""
CHECK_ONLY = "--check-only"
"""Launcher option (before ``--``): check the config and exit (0 or the check's code); torchrun never starts."""


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """``[torchrun options] -- [training arguments]`` -> the two lists (no ``--``: all training arguments)."""
    if "--" not in argv:
        return [], list(argv)
    i = argv.index("--")
    return list(argv[:i]), list(argv[i + 1 :])


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Hold back log records and Python warnings below ERROR while the config is checked here: the ranks
    log the same ones again, and bad input must end in exactly one line."""
    loggers = [logging.getLogger(), logging.getLogger("torch")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def accelerator_refusal(
    processes: int, driver: str | None, params: int | None, cuda: str | None
) -> str | None:
    """Why the launcher refuses to start ``processes`` ranks on a machine where torch sees no accelerator
    (they would train on the CPU), or None. A machine with an NVIDIA driver is refused whatever the number
    of processes (``devices.cuda_refusal``: torch cannot use the driver, most often one too old for torch's
    CUDA build); without one, several ranks of a model larger than ``CPU_RANKS_PARAMS`` (one process may
    always train any config on the CPU).

    Args:
        processes: NGPU x nodes.
        driver: ``nvidia_driver()``.
        params: the model's parameter count (None: unknown).
        cuda: the CUDA version torch is built for (``torch.version.cuda``; None: a CPU build).
    """
    if driver is not None:
        return cuda_refusal(driver, False, cuda)
    if processes <= 1 or params is None or params <= CPU_RANKS_PARAMS:
        return None
    return (
        f"NGPU x nodes = {processes}: no GPU is visible, so this would train a {params / 1e9:.1f}B-parameter "
        f"model on {processes} CPU ranks (gloo); run it on a GPU node, use a debug config "
        f"(train_configs/debug_model.toml), or set {ALLOW_CPU_RANKS}=1 to start {processes} CPU ranks anyway"
    )


def check_accelerator(config, processes: int) -> None:
    """``accelerator_refusal`` for this machine and ``config`` (nothing to check where torch sees an
    accelerator or ``ALLOW_CPU_RANKS`` is set).

    Raises:
        ConfigError: the refusal, one line.
    """
    if not cpu.needs_cpu_adapters() or os.environ.get(ALLOW_CPU_RANKS) == "1":
        return
    driver = nvidia_driver()
    params = None if driver or processes <= 1 else model_params(config)
    why = accelerator_refusal(processes, driver, params, torch.version.cuda)
    if why:
        raise ConfigError(why)


def check_gpu_count(args) -> None:
    """``devices.gpu_count_refusal`` for torchrun's processes per node and the GPUs torch sees here
    (nothing to check without a GPU: the ranks run on the CPU).

    Raises:
        ConfigError: the refusal, one line.
    """
    if not torch.cuda.is_available():
        return
    per_node = determine_local_world_size(args.nproc_per_node)
    why = gpu_count_refusal(per_node, torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    if why:
        raise ConfigError(why)


def model_params(config) -> int | None:
    """The configured model's parameter count, built on the meta device (no memory; 0.7 s for Llama 3
    8B); None when it cannot be built that way."""
    try:
        with torch.device("meta"):
            model = config.model_spec.model.build()
    except Exception:  # a model we cannot build on meta: say nothing rather than refuse on a guess
        return None
    return sum(p.numel() for p in model.parameters())


def check(training: list[str], processes: int, here: bool = True):
    """Resolve and check the whole config in this process (see the module docstring).

    Args:
        training: the training arguments.
        processes: NGPU x nodes.
        here: the ranks start on this machine, whose accelerator is judged (``check_accelerator``); False
            for ``--check-only``, which plans for GPUs elsewhere (``submit.sh`` on a login node without
            one): everything but this machine is checked.

    Returns:
        ``(config, checkpoint path the run resumes from or None)``.

    Raises:
        ConfigError, CheckpointError: one line each; ``SystemExit`` for ``--help`` (tyro prints it).
    """
    with quiet():
        config = build_config(training)
        if here:
            check_accelerator(config, processes)
        resume = check_run(config, processes)
        check_peak(config, processes, here)
        return config, resume


def nothing_to_do(config, resume: str | None) -> str | None:
    """The one line for a run whose checkpoint is already at ``training.steps`` (None: there is work)."""
    found = re.fullmatch(r"step-(\d+)", os.path.basename(resume or ""))
    steps = config.training.steps
    if found is None or int(found.group(1)) < steps:
        return None
    return (
        f"low-bits-training: nothing to do: {resume} is step {found.group(1)} and training.steps = {steps}; "
        "raise --training.steps to train on, or pick another dump_folder / [job] name to start afresh"
    )


def main(argv: list[str] | None = None, notes: Callable[[Any], list[str]] | None = None) -> int:
    """Check the config, then run torchrun; returns the exit code (``run/exits.py``: 0, 2 config, 3
    non-finite stop, 4 checkpoint, 1 crash, 128 + N for signal N).

    Args:
        argv: launcher arguments (default: ``sys.argv[1:]``).
        notes: lines to print (prefixed ``low-bits-training: ``) once the config is checked and before any
            rank starts, from the checked config: ``lbt-train`` / ``run_llama_train.sh`` pass the speed
            model's word on what a GPU run emulates (``cli.speed.run_notes``; titan cannot import speed).
    """
    options, training = split_argv(sys.argv[1:] if argv is None else argv)
    check_only = CHECK_ONLY in options
    args = torchrun_args([o for o in options if o != CHECK_ONLY], training)
    try:
        if not check_only:
            check_gpu_count(args)
        config, resume = check(training, world_size(args), here=not check_only)
        method = start_method(config)
    except Exception as e:
        known = classify(e)  # ConfigError 2, CheckpointError 4
        if known is None:
            raise
        print(known[1], file=sys.stderr)
        return known[0]
    done = nothing_to_do(config, resume)
    if done is not None:
        print(done, file=sys.stderr)
    peak = peak_check_of(config)
    lines = [f"memory: {peak.line()}"] if peak is not None and done is None else []
    for line in lines + (notes(config) if notes is not None and done is None else []):
        print(f"low-bits-training: {line}", file=sys.stderr, flush=True)
    if check_only or done is not None:
        return ExitCode.OK
    shown = show_the_loss(args, config, world_size(args))
    if shown is not None:
        print(shown, file=sys.stderr, flush=True)
    return run_torchrun(args, method)


if __name__ == "__main__":
    sys.exit(main())
