"""The byte budget of a run's training state: computed from its config, measured on its live tensors.

``planned`` builds the model on the meta device and the optimizers on it exactly as the trainer does
(torchtitan's param groups, our options), then counts bytes with ``optim.budget.state_bytes``: no tensor
memory. ``measured`` sums ``optim.live_bytes.live_bytes`` over every rank after an optimizer step. The trainer's
first step in each process (``report``) logs both as a table, writes them to ``<dump_folder>/state_bytes.json``
(``run.folder.STATE_BYTES_JSON``) and into the metrics (``memory/state_bytes_per_param/<state>``, measured,
and ``.../plan_total``); lbt-doctor shows the computed table (``cli/resource_checks.check_state_bytes``).

Layout modelled: FSDP2 / HSDP (rows sharded over data_parallel_shard x context_parallel ranks, padded;
replicated data_parallel_replicate times). TP / PP / EP placements are not: their ranks hold the same total
bytes, except for what they replicate (TP's norm weights) and a low-bit state whose blocks no longer fit a TP
shard (then fp32); the measured figure has those.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from low_bits_training.optim.budget import Sharding, StateBytes, format_budget, state_bytes
from low_bits_training.optim.live_bytes import live_bytes
from low_bits_training.run.folder import STATE_BYTES_JSON, STATE_BYTES_METRIC, write_atomic
from low_bits_training.titan.platform.ranks import rank, world_size

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def sharding_of(config: Any, processes: int) -> Sharding:
    """The ``Sharding`` a run of ``config`` on ``processes`` ranks holds its parameters in (torchtitan's
    ``ParallelDims``: data_parallel_shard_degree = -1 takes the ranks the other degrees leave)."""
    p = config.parallelism
    others = p.data_parallel_replicate_degree * p.context_parallel_degree * p.tensor_parallel_degree
    others *= p.pipeline_parallel_degree
    shard = p.data_parallel_shard_degree if p.data_parallel_shard_degree > 0 else max(1, processes // others)
    moments = torch.bfloat16 if config.optimizer.implementation == "fused_opt_states_bf16" else None
    return Sharding(
        shards=shard * p.context_parallel_degree,
        replicas=p.data_parallel_replicate_degree,
        param_dtype=_DTYPES[config.training.dtype],
        moment_dtype=moments,
    )


def _groups(optimizers) -> Iterator[tuple[str, tuple[int, ...], str, dict[str, Any]]]:
    """(FQN, shape, optimizer name, group options) of each parameter an optimizer container updates."""
    for opt in optimizers.optimizers:
        for g in opt.param_groups:
            group = {k: v for k, v in g.items() if k not in ("params", "param_names")}
            for fqn, p in zip(g["param_names"], g["params"], strict=True):
                yield fqn, tuple(p.shape), type(opt).__name__, group


def planned(config: Any, processes: int) -> StateBytes:
    """The computed budget of ``config`` on ``processes`` ranks (the model and optimizers built on meta).

    Raises:
        ValueError: an optimizer without a byte model (``optim.budget.STATE_MODELS``).
    """
    from torchtitan.tools.utils import set_default_dtype

    sharding = sharding_of(config, processes)
    with torch.device("meta"), set_default_dtype(sharding.param_dtype):
        model = config.model_spec.model.build()
        optimizers = config.optimizer.build(model_parts=[model])
    return state_bytes(_groups(optimizers), sharding)


def measured(model_parts: list[torch.nn.Module], optimizers) -> StateBytes:
    """The live bytes of every rank, summed (a collective: every rank calls it)."""
    params = {fqn: p for m in model_parts for fqn, p in m.named_parameters()}
    states = [st for opt in optimizers.optimizers for st in opt.state.values()]
    mine = live_bytes(params.values(), states)
    numel = {fqn: p.numel() for fqn, p in params.items()}
    gathered = [(mine.nbytes, mine.formats, numel)]
    if dist.is_available() and dist.is_initialized() and world_size() > 1:
        gathered = [None] * world_size()
        dist.all_gather_object(gathered, (mine.nbytes, mine.formats, numel))
    out, every = StateBytes(), {}
    for nbytes, formats, n in gathered:
        every.update(n)  # a parameter counted once, whichever ranks hold it (PP stages hold different ones)
        for state, b in nbytes.items():
            for fmt in formats[state]:
                out.add(state, 0, fmt)
            out.nbytes[state] += b
    out.numel = sum(every.values())
    return out


def budget_json(plan: StateBytes, live: StateBytes | None, per_token: Mapping | None) -> dict:
    """What ``state_bytes.json`` holds: each side's bytes, bytes per parameter and formats."""

    def side(b: StateBytes) -> dict:
        return {"bytes": b.nbytes, "bytes_per_param": b.per_param(), "formats": b.formats}

    return {
        "params": plan.numel,
        "ranks": world_size(),
        "planned": side(plan),
        "measured": side(live) if live is not None else None,
        "saved_bytes_per_token": dict(per_token) if per_token else None,
    }


def report(trainer, per_token: Mapping | None = None) -> None:
    """Once per process, after its first optimizer step: the computed and measured budgets as a logged
    table and ``state_bytes.json`` (rank 0), and metrics (the metrics rank); every rank measures.

    Args:
        trainer: the ``LowBitsTrainer`` (its config, model parts, optimizers, metrics).
        per_token: ``[[quantize.saved]]`` bytes per token (``titan.targets.saved.log_saved_bytes``: by the hooks,
            by the allocator, per module), written beside the state bytes and logged; None without rules.
    """
    if getattr(trainer, "_lbt_budget_done", False):
        return
    trainer._lbt_budget_done = True
    from torchtitan.tools.logging import logger

    live = measured(trainer.model_parts, trainer.optimizers)
    try:
        plan = planned(trainer.config, world_size())
    except ValueError as e:  # an optimizer we have no byte model for: the measured side alone
        logger.info(f"Training state bytes: no computed budget ({e})")
        plan = None
    metrics = {f"{STATE_BYTES_METRIC}/{s}": v for s, v in live.per_param().items()}
    if plan is not None:
        metrics[f"{STATE_BYTES_METRIC}/plan_total"] = plan.per_param()["total"]
    trainer.metrics_processor.logger.log(metrics, trainer.step)  # written by the metrics rank (last PP stage)
    if rank() != 0:
        return
    logger.info("Training state, bytes per parameter (all ranks):\n" + format_budget(plan or live, live))
    if per_token and "allocator" in per_token:
        logger.info(
            f"Saved for the backward ([[quantize.saved]], rank 0, step {trainer.step}): "
            f"{per_token['stored']:,.0f} B/token stored by the hooks, {per_token['allocator']:,.0f} held by the "
            f"allocator, {per_token['as_made']:,.0f} as made"
        )
    path = os.path.join(trainer.config.dump_folder, STATE_BYTES_JSON)
    os.makedirs(trainer.config.dump_folder, exist_ok=True)
    write_atomic(path, json.dumps(budget_json(plan or live, live, per_token), indent=1) + "\n")
