"""The numerics monitor: reads the quantized targets' in-graph probes between steps.

Each quantized target of every kind (linear layers, MoE expert weights, attention products: a
``nn.state.QuantState``) records its own operands' statistics and NaN / Inf flags inside the (compiled)
graph (``nn.probe``), under its plan entry's name. This module decides what the layers record each step (``probe.set_mode``), resets the
probes, and reads them: the flags once per microbatch (one host sync, in execution order so the *first*
non-finite value is named), the statistics at the end of a statistics step, reduced over all ranks here
(sums add, amax by MAX, the smallest scale by MIN), written to ``<dump_folder>/numerics.jsonl`` (rank 0)
and the headline numbers sent to TensorBoard / W&B through torchtitan's metrics logger.
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

from low_bits_training.config.numerics import NumericsConfig
from low_bits_training.nn import ROLE_NAMES, ProbeMode, probe
from low_bits_training.nn.probe import FLAG_SLOTS
from low_bits_training.nn.state import live_targets
from low_bits_training.numerics import NonFinite, identity, reduce_ops
from low_bits_training.numerics.records import NUMERICS_FILE, headline_metrics, rows
from low_bits_training.numerics.whatif import whatif_headlines
from low_bits_training.titan.platform.ranks import is_rank0, rank

from . import whatif

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_FORWARD_SLOTS = [i for i, s in enumerate(FLAG_SLOTS) if s.startswith("forward.")]
_BACKWARD_SLOTS = [i for i, s in enumerate(FLAG_SLOTS) if not s.startswith("forward.")]  # dgrad, then wgrad


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor -> this rank's shard


def reduce_raw(raw: torch.Tensor, group=None, ops: list[str] | None = None) -> torch.Tensor:
    """All-reduce a (K, SIZE) stack of raw statistics slot by slot (SUM / MAX / MIN); in place, returned.

    Args:
        raw: float64 raw vectors, the same keys in the same order on every rank.
        group: process group (None: the world).
        ops: the combine op per slot (default ``reduce_ops()``; what-if vectors: ``whatif_reduce_ops()``).
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return raw
    ops = ops or reduce_ops()
    for op in ("sum", "max", "min"):
        cols = [i for i, o in enumerate(ops) if o == op]
        part = raw[:, cols].contiguous()
        dist.all_reduce(part, op=_OPS[op], group=group)
        raw[:, cols] = part
    return raw


def _gather_union(local: dict) -> dict:
    """The union of every rank's dict (under PP each rank holds other layers)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, local)
    return {k: v for d in every for k, v in d.items()}


class NumericsMonitor:
    """Statistics and NaN checks for the quantized targets of ``model_parts`` (every kind)."""

    def __init__(
        self,
        config: NumericsConfig,
        model_parts: list[torch.nn.Module],
        dump_folder: str,
        layer_probes: bool = True,
        stats_steps=None,
        agree: bool = False,
        whatif_tables: dict | None = None,
    ):
        """``layer_probes`` False (``layer_probes_work``): the layers record nothing; the non-finite policy
        still checks each microbatch's loss and the gradients. ``stats_steps``: a ``step -> bool`` that asks
        for statistics on more steps than ``stats_freq`` (the autopilot's). ``agree``: every rank returns
        the same first non-finite value whatever the policy (the autopilot acts on it on every rank).
        ``whatif_tables``: FQN -> ``WhatIf`` of the resolved run (``ResolvedRun.whatif``; none: no what-if)."""
        self.cfg, self.dump_folder, self.layer_probes = config, dump_folder, layer_probes
        self.stats_steps, self.agree = stats_steps, agree
        self.step, self.stats_on, self.skip = 0, False, False
        self.layers = live_targets(model_parts)
        self.params = [(n, p) for m in model_parts for n, p in m.named_parameters()]
        self.active = bool(config.stats_freq) or config.nonfinite != "off" or stats_steps is not None
        # [numerics] whatif: titan/runtime/numerics/whatif.py
        self.whatif = whatif.attach(self.layers, whatif_tables or {})

    def close(self) -> None:
        """Switch the layers' probes off again."""
        probe.set_mode(ProbeMode())

    def begin_step(self, step: int) -> None:
        """Start ``step``: decide whether it collects statistics, reset the probes, set the probe mode."""
        f = self.cfg.stats_freq
        self.stats_on = bool(f) and (step == 1 or step % f == 0)
        self.stats_on = self.stats_on or bool(self.stats_steps and self.stats_steps(step))
        self.step, self.skip = step, False
        for _, layer in self.layers:
            probe.reset(layer.state)
        whatif.reset_all(self.whatif)
        on = self.layer_probes
        probe.set_mode(ProbeMode(stats=self.stats_on and on, nonfinite=on and self.cfg.nonfinite != "off"))

    def _ordered_flags(self, loss: torch.Tensor) -> tuple[list[tuple[str, str]], torch.Tensor]:
        """Every check of this microbatch in execution order: forward slots layer by layer, the loss,
        backward slots from the last layer back, then the gradients; and their flags (one tensor)."""
        names, flags = [], []
        for fqn, layer in self.layers:
            names += [(fqn, FLAG_SLOTS[i]) for i in _FORWARD_SLOTS]
            flags.append(layer.lbt_flags[_FORWARD_SLOTS])
        names.append(("loss", "loss"))
        flags.append(probe.nonfinite(_local(loss)).reshape(1))
        for fqn, layer in reversed(self.layers):
            names += [(fqn, FLAG_SLOTS[i]) for i in _BACKWARD_SLOTS]
            flags.append(layer.lbt_flags[_BACKWARD_SLOTS])
        grads = [(n, _local(p.grad)) for n, p in self.params if p.grad is not None]
        names += [(n, "grad") for n, _ in grads]
        flags += [probe.nonfinite(g).reshape(1) for _, g in grads]
        dev = loss.device
        return names, torch.cat([f.to(dev, torch.float32) for f in flags])

    def after_microbatch(self, loss: torch.Tensor) -> NonFinite | None:
        """Read this microbatch's flags (one sync), reset them, and agree across ranks.

        Returns:
            The first non-finite value (lowest rank that saw one) or None; the same on every rank for the
            "skip" / "stop" policies (they need every rank to act alike), this rank's own for "warn".
        """
        if self.cfg.nonfinite == "off":
            return None
        names, flags = self._ordered_flags(loss)
        hit = torch.nonzero(flags).flatten().tolist()  # the one host sync
        for _, layer in self.layers:
            layer.lbt_flags.zero_()
        mine = NonFinite(self.step, *names[hit[0]], rank()) if hit else None
        own = self.cfg.nonfinite == "warn" and not self.agree
        if own or not dist.is_initialized() or dist.get_world_size() == 1:
            return mine
        flag = torch.tensor([float(mine is not None)], device=loss.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return None
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return next(NonFinite(*e) for e in every if e is not None)

    def _local_stats(self) -> tuple[dict[tuple[str, str], torch.Tensor], dict[tuple[str, str], str]]:
        raw, specs = {}, {}
        for fqn, layer in self.layers:
            for i, (role, spec) in enumerate(zip(ROLE_NAMES, layer.plan.specs, strict=True)):
                if spec is not None:
                    raw[(fqn, role)] = layer.lbt_stats[i]
                    specs[(fqn, role)] = spec.short()
        return raw, specs

    def flush(self, metrics_logger) -> list[dict]:
        """End of a statistics step: reduce over ranks, write ``numerics.jsonl`` (rank 0), log headlines.

        Returns:
            The step's rows (the same on every rank; [] on a step without statistics).
        """
        if not self.stats_on:
            return []
        raw, specs = self._local_stats()
        specs = _gather_union(specs)
        keys = sorted(specs)
        table = []
        if keys:
            dev = next(iter(raw.values())).device if raw else torch.device("cpu")
            stack = torch.stack([raw[k] if k in raw else identity().to(dev) for k in keys])
            table = rows(self.step, keys, reduce_raw(stack), specs)
        alt = whatif.whatif_table(self.whatif, self.step, _gather_union, reduce_raw)  # rows marked "whatif"
        if not table and not alt:
            return []
        if is_rank0():
            with open(os.path.join(self.dump_folder, NUMERICS_FILE), "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in table + alt)
        if metrics_logger is not None:
            heads = headline_metrics(table, self.cfg.log_layers)
            metrics_logger.log({**heads, **whatif_headlines(alt, self.cfg.log_layers)}, self.step)
        return table


def layer_probes_work(pipeline_degree: int, compiled: bool) -> bool:
    """Whether the layers' in-graph probes can run: not under pipeline parallelism with torch.compile.

    A compiled block saves the probe tensors for its backward; a pipeline schedule runs the next
    microbatch's forward (which writes them) before this one's backward, and autograd refuses the saved
    tensor's new version. There the non-finite policy checks the loss and the gradients only, and
    statistics are refused before the run (``titan.launch.validate.check_numerics``).
    """
    return not (pipeline_degree > 1 and compiled)
