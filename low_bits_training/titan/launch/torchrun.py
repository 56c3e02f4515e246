"""torchrun in the launcher's own process: its arguments with this package's rank entry point, how the ranks
start (``start_method``: forked copies of this process on a CPU without compile, else fresh interpreters), and
a failed rank turned into one line and an exit code (``run_torchrun``; the choice of line: ``failures``).
The checks before it are ``launcher.py``'s."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from types import SimpleNamespace

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import (
    config_from_args,
    determine_local_world_size,
    elastic_launch,
    parse_args,
    parse_min_max_nnodes,
    run,
)

from low_bits_training.errors import ConfigError
from low_bits_training.run.exits import SIGNAL_BASE, ExitCode
from low_bits_training.titan.launch import worker
from low_bits_training.titan.launch.failures import HoldBack, chosen_failure, crash_report, crashed, shown
from low_bits_training.titan.launch.worker import UNDER_LAUNCHER
from low_bits_training.titan.platform import cpu
from low_bits_training.titan.platform.compat import metrics_rank

WORKER = "low_bits_training.titan.launch.worker"

_AGENT_LOGGER = "torch.distributed.elastic.multiprocessing.api"

START_METHOD = "LBT_START_METHOD"
"""``fork`` or ``spawn``: how the ranks start, instead of ``start_method``'s choice (``spawn`` on CPU gives each
rank a fresh interpreter, as on GPUs; ``fork`` with an accelerator is refused: CUDA does not survive it)."""


def torchrun_args(options: list[str], training: list[str]):
    """torchrun's own parse of ``options`` with this package's rank entry point and ``training``."""
    return parse_args([*options, "-m", WORKER, *training])


def world_size(args) -> int:
    """Processes of the run: (most) nodes x processes per node, as torchrun will start them."""
    _, max_nodes = parse_min_max_nnodes(args.nnodes)
    return max_nodes * determine_local_world_size(args.nproc_per_node)


def show_the_loss(args, config, processes: int) -> str | None:
    """Under pipeline parallelism only the last stage has the loss (torchtitan's metrics rank; the other
    stages log -1): the console shows that rank instead of rank 0, or besides the ranks ``LOG_RANK`` names.
    ``LOG_RANK`` for the ranks is set to match (torchtitan's own check reads it; its hint names a
    ``run_train.sh`` that is not ours).

    Returns:
        The line saying which ranks are shown (None: no pipeline, or the loss's rank is shown already).
    """
    p = config.parallelism
    if p.pipeline_parallel_degree <= 1 or not args.local_ranks_filter:  # no filter: every rank is shown
        return None
    dims = SimpleNamespace(pp_enabled=True, pp=p.pipeline_parallel_degree, world_size=processes)
    loss = metrics_rank(dims, p.pipeline_parallel_schedule)
    local = loss % determine_local_world_size(args.nproc_per_node)
    named = {int(r) for r in args.local_ranks_filter.split(",") if r.strip().isdigit()}
    chosen = "LOG_RANK" in os.environ  # the user's (run_llama_train.sh and train.sbatch default to 0)
    shown = named if local in named else (named | {local} if chosen else {local})
    args.local_ranks_filter = ",".join(map(str, sorted(shown)))
    os.environ["LOG_RANK"] = ",".join(map(str, sorted(shown | {loss})))
    if shown == named:
        return None
    return (
        f"low-bits-training: pipeline parallel: the loss is on rank {loss} (the last stage; the others log "
        f"-1), so the console shows rank(s) {args.local_ranks_filter} (LOG_RANK=0,{loss} shows rank 0 too)"
    )


def start_method(config) -> str:
    """How torchrun starts the ranks of ``config``: ``"fork"`` on a machine without an accelerator when
    torch.compile is off (a rank is a fork of this process, its imports done: a 1-step debug run starts
    ~10 s sooner), else ``"spawn"`` (a fresh interpreter per rank, as torchrun does). With GPUs a fork
    would carry no CUDA; under torch.compile forked ranks compiled 3.7x slower (748 s against 203 s of CPU
    for ``test_compiled_nvfp4_run_tracks_the_eager_run``; cause not found), so compiled runs spawn. The
    launcher runs no torch compute before the fork (its check builds on the meta device only); each
    rank sets its own thread count (OMP_NUM_THREADS).

    Raises:
        ConfigError: ``$LBT_START_METHOD`` is neither ``fork`` nor ``spawn``, or ``fork`` with an accelerator.
    """
    on_cpu = cpu.needs_cpu_adapters()
    chosen = os.environ.get(START_METHOD, "")
    if chosen not in ("", "fork", "spawn") or (chosen == "fork" and not on_cpu):
        allowed = (
            "'fork' or 'spawn'"
            if on_cpu
            else "'spawn' (an accelerator is visible: CUDA does not survive a fork)"
        )
        raise ConfigError(f"{START_METHOD} = {chosen!r}: expected {allowed}")
    return chosen or ("fork" if on_cpu and not config.compile.enable else "spawn")


def forked(args) -> None:
    """``torch.distributed.run.run(args)`` with each rank a forked copy of this process running
    ``forked_rank`` (the worker's ``main``) instead of ``python -m worker``."""
    torch.set_num_threads(1)  # this process computes nothing from here on; each rank sets its own count
    if args.master_port is None:
        args.master_port = 29500  # as torch.distributed.run.run (unused by the c10d rendezvous)
    config, _, _ = config_from_args(args)
    config.start_method = "fork"
    elastic_launch(config=config, entrypoint=forked_rank)(*args.training_script_args)


def forked_rank(*argv: str) -> None:
    """One rank in a forked launcher: the worker's ``main`` with its exit code as the process's. Output as
    ``python -u`` gives it, the rank's own threads (``OMP_NUM_THREADS``, as torchrun set it), and a crash's
    traceback printed to the rank's stderr (torchrun's ``record`` wrapper also writes it to the error file,
    which the launcher prints where LOG_RANK hides the rank: ``crash_report``)."""
    sys.stdout.reconfigure(line_buffering=True, write_through=True)
    sys.argv = [worker.__file__, *argv]
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
    try:
        code = worker.main(list(argv))
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        raise
    sys.stdout.flush()
    if code:
        sys.exit(int(code))


def run_torchrun(args, method: str = "spawn") -> int:
    """torchrun in this process; a failed rank becomes its one line and exit code (see ``chosen_failure``)."""
    os.environ[UNDER_LAUNCHER] = "1"  # the ranks inherit it: errors go to the error file
    hold = HoldBack()
    agent = logging.getLogger(_AGENT_LOGGER)
    agent.addFilter(hold)
    try:
        if method == "fork":
            forked(args)
        else:
            run(args)
        return ExitCode.OK
    except SignalException as e:
        return SIGNAL_BASE + int(e.sigval)
    except ChildFailedError as e:
        agent.removeFilter(hold)
        chosen = chosen_failure(e.failures)
        if chosen is not None:
            print(chosen[1], file=sys.stderr, flush=True)
            return chosen[0]
        for record in hold.held:
            record.exc_info = record.exc_text = None  # a forked rank's traceback: the rank's own, or below
            agent.handle(record)
        rank, failure = crashed(e.failures)
        print(crash_report(rank, failure, shown(args, failure.local_rank)), file=sys.stderr, flush=True)
        return ExitCode.CRASH
    finally:
        agent.removeFilter(hold)
