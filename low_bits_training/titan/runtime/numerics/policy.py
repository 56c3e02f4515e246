"""What happens around torchtitan's step: the numerics monitor, the non-finite policy (its error and exit code
live in ``run/exits.py``: ``NonFiniteError``, ``ExitCode.NONFINITE``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torchtitan.tools.logging import logger

from low_bits_training.numerics import NonFinite
from low_bits_training.run.exits import NonFiniteError
from low_bits_training.titan.runtime.autopilot import Autopilot
from low_bits_training.titan.runtime.profiling import step_context
from low_bits_training.titan.targets.registry import run_of

from .monitor import NumericsMonitor, layer_probes_work


def warn(event: NonFinite) -> None:
    """Log the one-line location of a non-finite value."""
    logger.warning(f"low-bits-training: {event.message()}")


class TrainerExtras:
    """What ``LowBitsTrainer`` adds around torchtitan's step: numerics statistics, the NaN policy, profiling."""

    def __init__(self, trainer):
        cfg = trainer.config
        self.trainer, self.cfg = trainer, cfg.numerics
        probes = layer_probes_work(cfg.parallelism.pipeline_parallel_degree, cfg.compile.enable)
        self.autopilot = None
        if cfg.quantize.autopilot.enable:  # [quantize.autopilot]: titan/runtime/autopilot/
            ckpt = cfg.checkpoint.interval if cfg.checkpoint.enable else 0
            self.autopilot = Autopilot(cfg.quantize.autopilot, trainer._lbt_schedule, cfg.dump_folder, ckpt)
        pilot = self.autopilot
        self.monitor = NumericsMonitor(
            cfg.numerics,
            trainer.model_parts,
            cfg.dump_folder,
            probes,
            stats_steps=pilot.stats_step if pilot else None,
            agree=pilot is not None,
            whatif_tables=run_of(cfg).whatif,  # resolved once per process, with the plan
        )
        if not probes and cfg.numerics.nonfinite != "off":
            logger.warning(
                "low-bits-training: numerics.nonfinite checks the loss and the gradients only under pipeline "
                "parallelism with torch.compile (the layers' per-role checks need eager or no PP)"
            )
        if cfg.numerics.nonfinite == "skip":
            trainer.optimizers.register_step_pre_hook(self._maybe_drop_grads)

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        """Around one training step: probes on/off, then reduce + log the statistics; the profiling extras."""
        if self.autopilot is not None:
            self.autopilot.begin_step(step)
        self.monitor.begin_step(step)
        with step_context(self.trainer.config.profiling, self.trainer.config.dump_folder, step):
            yield
        metrics_logger = getattr(self.trainer.metrics_processor, "logger", None)
        table = self.monitor.flush(metrics_logger)
        if self.autopilot is not None:
            self.autopilot.on_stats(step, table)
            promoted = self.autopilot.metrics()
            if promoted and metrics_logger is not None:
                metrics_logger.log(promoted, step)

    def after_microbatch(self, loss: torch.Tensor) -> torch.Tensor:
        """Apply the policy to this microbatch's first non-finite value, if any; returns the loss to log."""
        event = self.monitor.after_microbatch(loss)
        if event is None:
            return loss
        warn(event)
        if self.autopilot is not None:  # a promotion raises: the autopilot's step hook runs the step again
            self.autopilot.redo_if_promoted(event)
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
