"""torchtitan plumbing of the low-bit optimizers: a container that knows their names, and config checks.

``[[optimizer.param_groups]]`` entries name ``LowBitAdamW`` / ``LowBitSGD`` (ours) or torchao's ``AdamW8bit`` /
``AdamW4bit`` / ``AdamWFp8``; ``adapt_optimizer_config`` validates every group's kwargs (one-line
``ConfigError`` before the model is built) and swaps ``config.optimizer`` for this container's Config.
torchtitan's own ``state_dict`` (flat, FQN-keyed) then saves our states as DTensors placed like their
parameters, which DCP reshards (see docs/optimizers.md).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch.optim import Optimizer
from torchtitan.components.optimizer import OptimizersContainer

from low_bits_training.errors import ConfigError
from low_bits_training.optim import OPTIMIZERS

TORCHAO_OPTIMIZERS = ("AdamW8bit", "AdamW4bit", "AdamWFp8")
"""torchao.optim classes selectable by name (for comparison; their states do not reshard through DCP)."""
TORCHTITAN_OPTIMIZERS = ("Adam", "AdamW", "DistMuon")
_TORCHAO_KEYS = ("lr", "betas", "eps", "weight_decay", "amsgrad")


def _torchao_factory(name: str) -> Callable[..., Optimizer]:
    import torchao.optim

    return getattr(torchao.optim, name)


class LowBitOptimizersContainer(OptimizersContainer):
    """torchtitan's ``OptimizersContainer`` that also builds the optimizers named in ``OPTIMIZERS`` and
    ``TORCHAO_OPTIMIZERS``; everything else (param groups by pattern, flat DCP state dict) is torchtitan's."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., Optimizer]:
        if name in OPTIMIZERS:
            return OPTIMIZERS[name]
        if name in TORCHAO_OPTIMIZERS:
            return _torchao_factory(name)
        return OptimizersContainer._resolve_optimizer_factory(name)


def allowed_optimizer_names() -> tuple[str, ...]:
    return (*TORCHTITAN_OPTIMIZERS, *OPTIMIZERS, *TORCHAO_OPTIMIZERS)


def check_group(i: int, name: str, kwargs: dict[str, Any]) -> None:
    """Validate one ``[[optimizer.param_groups]]`` entry of ours or torchao's.

    Raises:
        ConfigError: one line naming ``optimizer.param_groups[i].<key>``, the value and the allowed values.
    """
    where = f"optimizer.param_groups[{i}]"
    if name not in allowed_optimizer_names():
        raise ConfigError(
            f"{where}.optimizer_name = {name!r}: allowed {', '.join(allowed_optimizer_names())}"
        )
    if name in OPTIMIZERS:
        try:
            OPTIMIZERS[name].options_cls.from_group(dict(kwargs))
        except (ValueError, TypeError) as e:
            raise ConfigError(f"{where}.optimizer_kwargs.{str(e).splitlines()[0]}") from None
    elif name in TORCHAO_OPTIMIZERS:
        bad = sorted(set(kwargs) - set(_TORCHAO_KEYS))
        if bad:
            raise ConfigError(
                f"{where}.optimizer_kwargs.{bad[0]}: not a {name} option; allowed {list(_TORCHAO_KEYS)}"
            )


def adapt_optimizer_config(config) -> None:
    """Validate the optimizer param groups and, when one names a low-bit or torchao optimizer, swap
    ``config.optimizer`` for ``LowBitOptimizersContainer.Config`` (same field values).

    torchao optimizers compile on their first step; each run gets its own inductor cache
    (``<dump_folder>/inductor_cache`` unless ``TORCHINDUCTOR_CACHE_DIR`` is set): mixed caches crash them.

    Raises:
        ConfigError: an unknown optimizer name or an invalid kwarg (one line).
    """
    groups = config.optimizer.param_groups
    for i, pg in enumerate(groups):
        check_group(i, pg.optimizer_name, pg.optimizer_kwargs)
    names = {pg.optimizer_name for pg in groups}
    if not names & (set(OPTIMIZERS) | set(TORCHAO_OPTIMIZERS)):
        return
    if names & set(TORCHAO_OPTIMIZERS):
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(config.dump_folder, "inductor_cache"))
    config.optimizer = container_config(config.optimizer)


def container_config(old):
    """torchtitan's optimizer config ``old`` as ``LowBitOptimizersContainer.Config`` (the same field values and
    objects; ``old`` itself if it is one): the container that builds our optimizers."""
    if isinstance(old, LowBitOptimizersContainer.Config):
        return old
    return LowBitOptimizersContainer.Config(
        **{f.name: getattr(old, f.name) for f in dataclasses.fields(old) if f.init}
    )


def in_backward_groups(config, on: bool = True) -> list[int]:
    """Indices of the ``[[optimizer.param_groups]]`` of our low-bit optimizers whose ``optimizer_kwargs.in_backward``
    is ``on`` (the launcher's check, the CUDA-graph policy and the fit planner read it here)."""
    return [i for i, pg in enumerate(config.optimizer.param_groups)
            if pg.optimizer_name in OPTIMIZERS and bool(pg.optimizer_kwargs.get("in_backward")) == on]  # fmt: skip


def check_in_backward(config, layout) -> None:
    """A group with ``optimizer_kwargs.in_backward = true`` updates each parameter as its gradient completes in
    the backward and frees it (``optim.base``; under FSDP2 each shard, once its reduce-scatter has run): that
    gradient must be the step's whole gradient, and nothing after the backward may need the gradients or undo
    the update.

    Args:
        config: the resolved config.
        layout: its parallel degrees (``launch.validate.Layout``).

    Raises:
        ConfigError: one line naming the group's key and the setting that conflicts with it.
    """
    groups = in_backward_groups(config)
    if not groups:
        return
    where = f"optimizer.param_groups[{groups[0]}].optimizer_kwargs.in_backward = true"
    t = config.training
    # FSDP2 (data_parallel_shard_degree) calls the hooks on each sharded parameter after its reduce-scatter
    degrees = {"data_parallel_replicate_degree": layout.dp_replicate, "context_parallel_degree": layout.cp,
               "tensor_parallel_degree": layout.tp, "pipeline_parallel_degree": layout.pp}  # fmt: skip
    conflicts = [f"parallelism.{k} = {v} (the gradients are reduced or split after the backward)"
                 for k, v in degrees.items() if v > 1]  # fmt: skip
    if t.max_norm != float("inf"):
        conflicts.append(f"training.max_norm = {t.max_norm} (clipping needs every gradient; set it to inf)")
    if t.global_batch_size not in (-1, t.local_batch_size * layout.data_ranks):
        conflicts.append(f"training.global_batch_size = {t.global_batch_size} (gradient accumulation)")
    if config.numerics.nonfinite == "skip":
        conflicts.append('numerics.nonfinite = "skip" (the update has happened when the check runs)')
    if config.quantize.autopilot.enable:
        conflicts.append("quantize.autopilot.enable = true (it may run a step again)")
    if conflicts:
        raise ConfigError(f"{where}: updates in the backward, so not with {conflicts[0]}")
