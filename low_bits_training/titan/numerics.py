"""``[numerics]``: quantization statistics every N steps and NaN / Inf detection, wired into the trainer.

The quantized matmul reports its operands through ``nn.observe``; forward / backward pre-hooks on every
``QuantLinear`` name the module. On a statistics step each (layer, role) accumulates a raw statistics vector
(``numerics.stats``); at the end of the step the vectors are reduced over all ranks here (sums add, amax by
MAX, the smallest scale by MIN), then written to ``<dump_folder>/numerics.jsonl`` (rank 0) and the headline
numbers to TensorBoard / W&B through torchtitan's metrics logger. Non-finite checks flag every GEMM operand,
the loss and every gradient on every step (device flags, one host sync per microbatch).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

from low_bits_training.nn import observe
from low_bits_training.nn.linear import QuantLinear
from low_bits_training.numerics import FirstNonFinite, NonFinite, combine, identity, operand_stats, reduce_ops
from low_bits_training.numerics.records import NUMERICS_FILE, headline_metrics, rows

Policy = Literal["off", "warn", "skip", "stop"]
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass(kw_only=True, slots=True)
class NumericsConfig:
    """``[numerics]``: quantization statistics and what to do with NaN / Inf (see docs/numerics.md)."""

    stats_freq: int = 0
    """Collect statistics of every quantized GEMM operand on step 1 and every ``stats_freq`` steps (0: off)."""
    nonfinite: Policy = "warn"
    """On a NaN / Inf in a GEMM operand, the loss or a gradient: "warn" (log step/module/role/rank),
    "skip" (also drop that optimizer step), "stop" (save the last good state if checkpointing is on, exit 3),
    "off" (no checks)."""
    log_layers: bool = False
    """Also send every layer's underflow / saturation / SQNR to TensorBoard / W&B (the JSONL has them all)."""

    def check(self) -> None:
        """Raises: ValueError (one line) for a negative ``stats_freq`` or an unknown policy."""
        if not isinstance(self.stats_freq, int) or self.stats_freq < 0:
            raise ValueError(f"numerics.stats_freq = {self.stats_freq!r}: expected an int >= 0 (0: off)")
        if self.nonfinite not in ("off", "warn", "skip", "stop"):
            raise ValueError(
                f"numerics.nonfinite = {self.nonfinite!r}: expected one of off, warn, skip, stop"
            )


class NonFiniteError(RuntimeError):
    """Raised on every rank by the "stop" policy; the message is the one line for the user."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor -> this rank's shard


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def reduce_raw(raw: torch.Tensor, group=None) -> torch.Tensor:
    """All-reduce a (K, SIZE) stack of raw statistics slot by slot (SUM / MAX / MIN); in place, returned.

    Args:
        raw: float64 raw vectors, the same keys in the same order on every rank.
        group: process group (None: the world).
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return raw
    ops = reduce_ops()
    for op in ("sum", "max", "min"):
        cols = [i for i, o in enumerate(ops) if o == op]
        part = raw[:, cols].contiguous()
        dist.all_reduce(part, op=_OPS[op], group=group)
        raw[:, cols] = part
    return raw


def _union_keys(keys: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Sorted union of every rank's (layer, role) keys (under PP each rank holds other layers)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return sorted(keys)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, keys)
    return sorted({tuple(k) for ks in every for k in ks})


class NumericsMonitor:
    """Statistics and NaN checks for the ``QuantLinear`` modules of ``model_parts``."""

    def __init__(self, config: NumericsConfig, model_parts: list[torch.nn.Module], dump_folder: str):
        self.cfg, self.dump_folder = config, dump_folder
        self.step, self.stats_on, self.skip = 0, False, False
        self.raw: dict[tuple[str, str], torch.Tensor] = {}
        self.specs: dict[tuple[str, str], str] = {}
        self.tracker = FirstNonFinite()
        self.params = [(n, p) for m in model_parts for n, p in m.named_parameters()]
        self._undo: list = []
        if config.stats_freq or config.nonfinite != "off":
            self._install(model_parts)

    def _install(self, model_parts: list[torch.nn.Module]) -> None:
        for part in model_parts:
            for fqn, mod in part.named_modules():
                if isinstance(mod, QuantLinear):
                    name = fqn.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
                    self._undo.append(
                        mod.register_forward_pre_hook(lambda m, a, n=name: observe.set_module(n))
                    )
                    self._undo.append(
                        mod.register_full_backward_pre_hook(lambda m, g, n=name: observe.set_module(n))
                    )
        for remove in (observe.add(self._observe), observe.add_output(self._observe_output)):
            self._undo.append(type("H", (), {"remove": staticmethod(remove)})())

    def close(self) -> None:
        """Remove the hooks and the observer."""
        for h in self._undo:
            h.remove()
        self._undo.clear()

    def _observe(self, fqn: str, role, t: torch.Tensor, spec) -> None:
        t = _local(t)
        if self.cfg.nonfinite != "off":
            self.tracker.check(fqn, role.name, t)
        if self.stats_on and spec is not None:
            key, raw = (fqn, role.name), operand_stats(t, spec)
            self.raw[key] = combine(self.raw[key], raw) if key in self.raw else raw
            self.specs[key] = spec.short()

    def _observe_output(self, fqn: str, gemm: str, y: torch.Tensor) -> None:
        if self.cfg.nonfinite != "off":
            self.tracker.check(fqn, f"{gemm}.output", _local(y))

    def begin_step(self, step: int) -> None:
        """Start ``step``: decide whether it collects statistics; forget the last step's flags."""
        f = self.cfg.stats_freq
        self.step, self.stats_on, self.skip = step, bool(f) and (step == 1 or step % f == 0), False
        self.raw.clear()
        self.tracker.reset()

    def after_microbatch(self, loss: torch.Tensor) -> NonFinite | None:
        """Check the loss and gradients, read this microbatch's flags (one sync) and agree across ranks.

        Returns:
            The first non-finite value (lowest rank that saw one) or None; the same on every rank for the
            "skip" / "stop" policies (they need every rank to act alike), this rank's own for "warn".
        """
        if self.cfg.nonfinite == "off":
            return None
        self.tracker.check("loss", "loss", _local(loss))
        for name, p in self.params:
            if p.grad is not None:
                self.tracker.check(name, "grad", _local(p.grad))
        hit = self.tracker.first()
        self.tracker.reset()
        mine = NonFinite(self.step, *hit, _rank()) if hit else None
        if self.cfg.nonfinite == "warn" or not dist.is_initialized() or dist.get_world_size() == 1:
            return mine
        flag = torch.tensor([float(mine is not None)], device=loss.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return None
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        return next(NonFinite(*e) for e in every if e is not None)

    def flush(self, metrics_logger) -> None:
        """End of a statistics step: reduce over ranks, write ``numerics.jsonl`` (rank 0), log headlines."""
        if not self.stats_on:
            return
        keys = _union_keys(list(self.raw))
        dev = next(iter(self.raw.values())).device if self.raw else torch.device("cpu")
        stack = torch.stack([self.raw.get(k, identity().to(dev)) for k in keys]) if keys else None
        if stack is None:
            return
        stack = reduce_raw(stack)
        specs = self.specs
        if dist.is_initialized() and dist.get_world_size() > 1:
            every: list = [None] * dist.get_world_size()
            dist.all_gather_object(every, specs)
            specs = {k: v for s in every for k, v in s.items()}
        table = rows(self.step, keys, stack, specs)
        if _rank() == 0:
            with open(os.path.join(self.dump_folder, NUMERICS_FILE), "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in table)
        if metrics_logger is not None:
            metrics_logger.log(headline_metrics(table, self.cfg.log_layers), self.step)
        self.raw.clear()


def warn(event: NonFinite) -> None:
    """Log the one-line location of a non-finite value."""
    logger.warning(f"low-bits-training: {event.message()}")


class TrainerExtras:
    """What ``LowBitsTrainer`` adds around torchtitan's step: numerics statistics, the NaN policy, profiling."""

    def __init__(self, trainer):
        cfg = trainer.config
        self.trainer, self.cfg = trainer, cfg.numerics
        self.monitor = NumericsMonitor(cfg.numerics, trainer.model_parts, cfg.dump_folder)
        self._last_event: NonFinite | None = None
        if cfg.numerics.nonfinite == "skip":
            trainer.optimizers.register_step_pre_hook(self._maybe_drop_grads)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one training step: statistics on/off, then reduce + log them; the profiling extras."""
        from low_bits_training.titan.profiling import step_context

        self.monitor.begin_step(step)
        with step_context(self.trainer.config.profiling, self.trainer.config.dump_folder, step):
            yield
        self.monitor.flush(getattr(self.trainer.metrics_processor, "logger", None))

    def after_microbatch(self, loss: torch.Tensor) -> torch.Tensor:
        """Apply the policy to this microbatch's first non-finite value, if any; returns the loss to log."""
        event = self.monitor.after_microbatch(loss)
        if event is None:
            return loss
        warn(event)
        if self.cfg.nonfinite == "stop":
            self._stop(event)
        if self.cfg.nonfinite == "skip":
            self.monitor.skip = True
            return torch.nan_to_num(loss, nan=0.0, posinf=0.0, neginf=0.0)  # torchtitan raises on a NaN loss
        return loss

    def _maybe_drop_grads(self, *_args) -> None:
        # Optimizer step pre-hook: parameters without a gradient are left alone by the optimizer (no
        # moment update, no weight decay), so dropping every gradient skips the step exactly.
        if self.monitor.skip:
            logger.warning(
                f"low-bits-training: optimizer step {self.monitor.step} skipped (numerics.nonfinite)"
            )
            for _, p in self.monitor.params:
                p.grad = None

    def _stop(self, event: NonFinite) -> None:
        """Keep the last good state (the weights before this step's update) and raise ``NonFiniteError``."""
        t, good = self.trainer, event.step - 1
        ckpt = t.checkpointer
        if getattr(ckpt, "enable", False) and good >= 1 and good % ckpt.interval:
            t.step = good  # the checkpoint's "step" must name the state it holds
            try:
                ckpt.save(good, last_step=True)
                ckpt.maybe_wait_for_saving()
            finally:
                t.step = event.step
        raise NonFiniteError(event.message())


def extras_for(trainer) -> TrainerExtras:
    """The trainer's ``TrainerExtras``, built on first use (after torchtitan built the model)."""
    extras = trainer.__dict__.get("_lbt_extras")
    if extras is None:
        extras = trainer.__dict__["_lbt_extras"] = TrainerExtras(trainer)
    return extras


def exit_on_nonfinite(run, config) -> int:
    """``run(config)``; a ``NonFiniteError`` becomes its one-line message on stderr and exit code 3.

    Returns:
        0 after a complete run, 3 when the "stop" policy ended it.
    """
    import sys

    try:
        run(config)
    except NonFiniteError as e:
        print(f"low-bits-training: stopped: {e}", file=sys.stderr)
        return 3
    return 0
