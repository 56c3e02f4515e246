"""The torchtitan ``Trainer`` with the sections low-bits-training adds to its config tree."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torchtitan.trainer import Trainer

from low_bits_training.config.job import JobConfig
from low_bits_training.config.memory import MemoryConfig
from low_bits_training.config.numerics import NumericsConfig
from low_bits_training.config.profiling import ProfilingConfig
from low_bits_training.config.quantize import QuantizeConfig
from low_bits_training.formats import derive_key
from low_bits_training.nn import rng as layer_rng
from low_bits_training.nn import saved as nn_saved
from low_bits_training.run.secrets import redact
from low_bits_training.titan.platform.ranks import rank
from low_bits_training.titan.runtime import budget
from low_bits_training.titan.runtime.autopilot import run_step
from low_bits_training.titan.runtime.manifest import fingerprint
from low_bits_training.titan.runtime.numerics import extras_for
from low_bits_training.titan.runtime.peak_log import log_peak
from low_bits_training.titan.targets.collectives import log_comm_bytes
from low_bits_training.titan.targets.delayed import install as install_amax_group
from low_bits_training.titan.targets.experts import zero_expert_counts
from low_bits_training.titan.targets.registry import live, run_of
from low_bits_training.titan.targets.saved import allocator_meter, log_saved_bytes
from low_bits_training.titan.targets.schedule import install as install_schedule


def step_seed(base: int, step: int) -> int:
    """The global RNG seed of one training step (``derive_key(base seed, step)``)."""
    return derive_key(base, step)


def microbatch_key(base: int, step: int, microbatch: int, rank: int) -> int:
    """The quantized layers' stochastic-rounding step key of one microbatch on one rank (``nn.rng``)."""
    return derive_key("sr", base, step, microbatch, rank)


class LowBitsTrainer(Trainer):
    """torchtitan's Trainer; later sections (precision plan, numerics) hook in here."""

    def __init__(self, config: Config):
        super().__init__(config)
        if hasattr(self.checkpointer, "fingerprint"):  # a resume checks the checkpoint against this run
            self.checkpointer.fingerprint = fingerprint(config)
        # torchtitan seeded this rank (debug.seed; distinct per PP stage): every step's stream derives from it.
        self._rng_base_seed = torch.initial_seed()
        self._microbatch = 0
        for fqn, target in live(self.model_parts):  # each target rounds with its own random bits
            target.set_name(fqn)
        # [[quantize.phases]], [quantize.eval]: titan/targets/schedule.py, from the run resolved in build_config
        self._lbt_schedule = install_schedule(self, run_of(config))
        # delayed scaling: one amax history on every data rank (titan/targets/delayed.py)
        install_amax_group(self)
        in_backward = [o for o in self.optimizers.optimizers if getattr(o, "updates_in_backward", False)]
        if in_backward:  # the logged grad_norm counts the gradients updated and freed in the backward
            self.metrics_processor.in_backward_norms = lambda: [
                o.grad_norm_in_backward().item() for o in in_backward
            ]

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        job: JobConfig = field(default_factory=JobConfig)
        """``[job]``: base config and run name."""

        quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
        """``[quantize]``: the precision plan, a number format per GEMM operand of each linear layer
        (recipe, backend, skip, rules; see docs/precision_plan.md)."""
        numerics: NumericsConfig = field(default_factory=NumericsConfig)
        """``[numerics]``: quantization statistics every N steps, NaN / Inf policy (docs/numerics.md)."""
        profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
        """``[profiling]``: extras beside torchtitan's ``[profiler]``: FLOP table, CPU memory timeline."""
        memory: MemoryConfig = field(default_factory=MemoryConfig)
        """``[memory]``: the peak-memory plan's limit and check (docs/memory.md)."""

        def to_dict(self) -> dict:
            # What torchtitan prints (debug.print_config), saves (debug.save_config_file) and sends to W&B.
            return redact(Trainer.Config.to_dict(self))

    def train_step(self, data_iterator):
        """torchtitan's step between the numerics / profiling bookkeeping (see titan/runtime/numerics).

        The global RNG (dropout, if a model has any) is reseeded from (base seed, step) first, and every
        microbatch sets the quantized layers' stochastic-rounding key from (base seed, step, microbatch,
        rank) (nn/rng.py). A resumed run then draws the same numbers as an uninterrupted one, with no RNG
        state to checkpoint, compiled or eager.

        With ``[quantize.autopilot]`` the autopilot's step hook runs the step (``autopilot.run_step``): a
        step whose attempt promoted a role runs again with the same batches, and a spike rolls the state
        back to a host snapshot, the steps after it run again with the batches they drew the first time,
        before torchtitan's loop goes on.
        """
        run_step(extras_for(self).autopilot, self, data_iterator, self._lbt_attempt, self._lbt_dropped)

    def _lbt_attempt(self, batches) -> None:
        """torchtitan's step at ``self.step`` once on ``batches``, then this step's byte logs (not reached
        when the autopilot drops the attempt: ``RedoStep`` goes through)."""
        torch.manual_seed(step_seed(self._rng_base_seed, self.step))
        self._microbatch = 0
        self._lbt_schedule.begin_step(self.step)  # the plan of this step's phase
        with extras_for(self).step(self.step), allocator_meter(self):
            super().train_step(batches)
        log_comm_bytes(self)  # [quantize.comm] bytes on the wire this step (titan/targets/collectives.py)
        log_peak(self)  # the peak the allocator measured on one step, beside the plan (titan/runtime/peak.py)
        # [[quantize.saved]] bytes kept for the backward (titan/targets/saved.py), by the allocator on one step
        per_token = log_saved_bytes(self)
        if per_token is None or "allocator" in per_token:
            # bytes per parameter of each state, once (titan/runtime/budget.py)
            budget.report(self, per_token)

    def _lbt_dropped(self) -> None:
        """Forget what an attempt the autopilot dropped left behind, before the step runs again."""
        nn_saved.take_bytes()  # what the dropped attempt saved is not this step's
        zero_expert_counts(self.model_parts)  # nor what it routed (MoE load balancing)

    def forward_backward_step(self, **kwargs):
        """torchtitan's microbatch (with its own SR key), then the NaN checks of loss, gradients and GEMM
        operands and their policy. Under PP the schedule's microbatches share one key."""
        layer_rng.set_step_key(microbatch_key(self._rng_base_seed, self.step, self._microbatch, rank()))
        self._microbatch += 1
        return extras_for(self).after_microbatch(super().forward_backward_step(**kwargs))
