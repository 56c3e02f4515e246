"""What to change so that a run fits: each candidate change planned (``peak.plan_peak``) until one fits, and
the planning run in a forked child (the launcher's ranks are forked after it)."""

from __future__ import annotations

import contextlib
import copy
import math
import multiprocessing
import traceback
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from low_bits_training.config.saved import SavedRule
from low_bits_training.errors import ConfigError
from low_bits_training.titan.platform.compat import compile_in_this_process
from low_bits_training.titan.platform.cpu import needs_cpu_adapters, repoint_at_cpu
from low_bits_training.titan.runtime.optim import check_in_backward, container_config, in_backward_groups
from low_bits_training.titan.runtime.peak import NotPlanned, PeakPlan, plan_peak
from low_bits_training.titan.targets import saved
from low_bits_training.titan.targets.registry import resolve_run


def _candidates(config: Any, world_size: int = 1) -> list[tuple[str, dict[str, Any]]]:
    """``[(the change as a user makes it, {config attribute: value})]`` of the changes ``cheapest_fit`` tries,
    cheapest first. First those that keep the numbers (up to the order of sums): selective activation
    checkpointing (recomputes the cheap ops; where no AC runs), full (recomputes each block), the low-bit
    optimizers' updates in the backward (no gradients held; one rank or FSDP2, no clipping: only where
    ``check_in_backward`` allows it). Then those that change formats, each with its loss cost measured in
    docs/memory.md: the blocks' saved activations in e4m3 (where no ``[[quantize.saved]]`` rule is set), smaller
    AdamW states (``_state_formats``). Last the local batch halved while above 1 (the global batch kept by
    gradient accumulation: the same numbers, at a fraction of the device's throughput)."""
    out = []
    ac = config.activation_checkpoint
    if ac is None:
        out.append(("--activation_checkpoint selective", {"activation_checkpoint": SelectiveAC.Config()}))
    if not isinstance(ac, FullAC.Config):
        out.append(("--activation_checkpoint full", {"activation_checkpoint": FullAC.Config()}))
    out += _in_backward(config, world_size)
    out += _saved_e4m3(config)
    out += _state_formats(config)
    t = config.training
    keep = t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size
    batch = t.local_batch_size
    while batch > 1:
        batch //= 2
        flags = f"--training.local_batch_size {batch} --training.global_batch_size {keep}"
        out.append((flags, {"training.local_batch_size": batch, "training.global_batch_size": keep}))
    return out


SAVED_E4M3 = '[[quantize.saved]] modules = ["layers.*"], format = "e4m3"'
"""The saved-activation rule offered: what the lean preset sets (each block's saved tensors in e4m3, one scale
per row; docs/memory.md measures its bytes and loss)."""
FOUR_BIT = {"exp_avg": "e2m1_block128", "exp_avg_sq": "int4_block128"}
"""The 4-bit presets' AdamW moments (docs/memory.md: their 200-step loss gap and bytes)."""


def _saved_e4m3(config: Any) -> list[tuple[str, dict[str, Any]]]:
    """The ``SAVED_E4M3`` rule, where no ``[[quantize.saved]]`` rule is set and the run takes it (not inside
    compiled blocks): the rule, and the spec's ``parallelize_fn`` hooked by the saved kind for the run resolved
    with it (the hooks come from the resolved formats, not the config: ``apply_run`` installed them before)."""
    if config.quantize.saved:
        return []
    quantize = copy.copy(config.quantize)
    quantize.saved = [SavedRule(modules=["layers.*"], format="e4m3")]
    try:
        run = resolve_run(config, quantize_cfg=quantize)
    except ConfigError:
        return []
    if not run.saved:
        return []
    spec = config.model_spec
    before = spec.parallelize_fn
    saved.KIND.convert(config, run)  # the kind's own hook-up, as apply_run makes it
    hooked, spec.parallelize_fn = spec.parallelize_fn, before
    return [(SAVED_E4M3, {"quantize.saved": quantize.saved, "model_spec.parallelize_fn": hooked})]


def _state_formats(config: Any) -> list[tuple[str, dict[str, Any]]]:
    """Smaller AdamW states, in two steps: torch's AdamW groups as LowBitAdamW with its defaults (int8 moments:
    2 bytes a parameter where torch's fp32 ones take 8), then every AdamW group's moments in the 4-bit
    presets' formats (1 byte a parameter); each offered where some group would change."""
    groups = config.optimizer.param_groups
    torch_adamw = [i for i, pg in enumerate(groups) if pg.optimizer_name == "AdamW"]
    adamw = [i for i, pg in enumerate(groups) if pg.optimizer_name in ("AdamW", "LowBitAdamW")]
    out = []
    name: dict[str, Any] = {"optimizer": container_config(config.optimizer)}  # first: the groups are shared
    name |= {f"optimizer.param_groups.{i}.optimizer_name": "LowBitAdamW" for i in torch_adamw}
    if torch_adamw:
        out.append((f'optimizer_name = "LowBitAdamW" in {_where(torch_adamw)} (int8 moments)', name))
    four = [i for i in adamw if any(groups[i].optimizer_kwargs.get(k) != v for k, v in FOUR_BIT.items())]
    if four:
        kwargs = ", ".join(f'{k} = "{v}"' for k, v in FOUR_BIT.items())
        changes = name | {
            f"optimizer.param_groups.{i}.optimizer_kwargs.{k}": v for i in four for k, v in FOUR_BIT.items()
        }
        where = _where(four) if not torch_adamw else f'{_where(four)} with optimizer_name = "LowBitAdamW"'
        out.append((f"{kwargs} in {where}", changes))
    return out


def _where(groups: list[int]) -> str:
    return ", ".join(f"optimizer.param_groups[{i}]" for i in groups)


def _in_backward(config: Any, world_size: int) -> list[tuple[str, dict[str, Any]]]:
    """The change to ``in_backward`` of every low-bit optimizer group without it, if the run allows it (one
    rank, or FSDP2 alone over ``world_size`` ranks)."""
    groups = in_backward_groups(config, on=False)
    if not groups:
        return []
    changes: dict[str, Any] = {
        f"optimizer.param_groups.{i}.optimizer_kwargs.in_backward": True for i in groups
    }
    changes["training.max_norm"] = math.inf
    d = ParallelDims.from_config(config.parallelism, world_size)  # data_parallel_shard_degree -1 filled in
    layout = SimpleNamespace(dp_replicate=d.dp_replicate, dp_shard=d.dp_shard, cp=d.cp, tp=d.tp, pp=d.pp,
                             data_ranks=d.dp_replicate * d.dp_shard)  # fmt: skip
    with _changed(config, changes):
        try:
            check_in_backward(config, layout)
        except ConfigError:  # DDP / TP / CP / PP, accumulation, the autopilot, NaN skipping: not to offer
            return []
    return [
        (f"optimizer_kwargs.in_backward = true in {_where(groups)} with --training.max_norm inf", changes)
    ]


_MISSING = object()


def _owner(config: Any, key: str) -> tuple[Any, str]:
    *path, name = key.split(".")
    for part in path:
        config = config[int(part)] if part.isdigit() else getattr(config, part)
    return config, name


@contextlib.contextmanager
def _changed(config: Any, changes: dict[str, Any]):
    """``config`` with ``changes`` (dotted paths of attributes, list indices and dict keys) applied, restored
    after."""
    old = {}
    for key, value in changes.items():
        owner, name = _owner(config, key)
        if isinstance(owner, dict):
            old[key] = owner.get(name, _MISSING)
            owner[name] = value
        else:
            old[key] = getattr(owner, name)
            setattr(owner, name, value)
    try:
        yield config
    finally:
        for key, value in old.items():
            owner, name = _owner(config, key)
            if not isinstance(owner, dict):
                setattr(owner, name, value)
            elif value is _MISSING:
                del owner[name]
            else:
                owner[name] = value


def cheapest_fit(
    config: Any,
    world_size: int,
    limit: int,
    device_type: str,
    model_of: Callable[[Any], Any],
    tries: int | None = 4,
    every: bool = False,
) -> list[tuple[str, PeakPlan]]:
    """The changes of ``_candidates`` planned in order (at most ``tries``; None: all), until one brings the planned peak
    under ``limit`` bytes (``every``: all of them): ``[(flags, PeakPlan)]`` of those planned, in that order."""
    out = []
    for flags, changes in _candidates(config, world_size)[:tries]:
        with _changed(config, changes):
            plan = plan_peak(config, world_size, device_type, model_of)
        out.append((flags, plan))
        if plan.peak <= limit and not every:
            break
    return out


def ranked(
    config: Any, world_size: int, limit: int, device_type: str, model_of: Callable[[Any], Any]
) -> list:
    """lbt-doctor ``--fit``: the run as it is and every change of ``_candidates`` planned, those under
    ``limit`` bytes first in ``_candidates``' order (cheapest first), then the rest by planned peak:
    ``[(flags or "(as configured)", PeakPlan, fits)]``."""
    rows = [("(as configured)", plan_peak(config, world_size, device_type, model_of))]
    rows += cheapest_fit(config, world_size, limit, device_type, model_of, tries=None, every=True)
    fits = [(f, p, True) for f, p in rows if p.peak <= limit]
    over = sorted(((f, p, False) for f, p in rows if p.peak > limit), key=lambda r: r[1].peak)
    return fits + over


FORK_AFTER_AUTOGRAD = "Unable to handle autograd's threading in combination with fork-based multiprocessing"
"""What torch raises in a forked child whose parent already ran autograd."""
CHILD_SECONDS = 600
"""How long the launcher waits for the plan (Llama 3 8B: 20-30 s on a 2-core CPU); then it goes on unplanned."""


def _child(conn, fn, args) -> None:
    torch.set_num_threads(1)  # the parent's OpenMP pool does not survive a fork; fake tensors need no threads
    compile_in_this_process()  # nor inductor's compile pool (the optimizer's workspace is measured compiled)
    if not needs_cpu_adapters():  # a GPU node: the plan's meshes and fake tensors are the CPU's
        repoint_at_cpu()
    try:
        conn.send(("ok", fn(*args)))
    except NotPlanned as e:
        conn.send(("not planned", str(e)))
    except BaseException as e:  # said by the parent, with its traceback
        conn.send(("failed", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def in_child(fn, *args):
    """``fn(*args)`` in a forked child process, its result returned here. The planner runs autograd on fake
    tensors; done in the launcher itself, its ranks forked after (torchrun on the CPU) could not run
    autograd ("Unable to handle autograd's threading in combination with fork-based multiprocessing").

    Raises:
        NotPlanned: what ``fn`` raised as such; any other failure as ``NotPlanned`` naming it (the caller
            says it in a warning: the run goes on unplanned).
    """
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, fn, args), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(CHILD_SECONDS):
            proc.kill()
            raise NotPlanned(f"the planner did not finish in {CHILD_SECONDS} s")
        kind, value = parent.recv()
    except EOFError:
        kind, value = "failed", f"the planning process ended with exit code {proc.join() or proc.exitcode}"
    proc.join()
    if kind == "failed" and FORK_AFTER_AUTOGRAD in value:
        # this process already ran autograd (a test process), so its forks cannot: plan here instead; the
        # launcher never has (its ranks are what a plan made here would break)
        return fn(*args)
    if kind == "ok":
        return value
    raise NotPlanned(value if kind == "not planned" else f"the planner failed: {value}")


def plan_and_fit(
    config: Any, world_size: int, device_type: str, model_of: Callable[[Any], Any], limit: int
) -> tuple[PeakPlan, list]:
    """The plan, and over ``limit`` bytes (0: none) the changes ``cheapest_fit`` tried."""
    plan = plan_peak(config, world_size, device_type, model_of)
    fits = (
        cheapest_fit(config, world_size, limit, device_type, model_of) if limit and plan.peak > limit else []
    )
    return plan, fits
