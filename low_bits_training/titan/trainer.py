"""The torchtitan ``Trainer`` with the sections low-bits-training adds to its config tree."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
from torchtitan.trainer import Trainer

from low_bits_training.config.plan import QuantizeConfig
from low_bits_training.config.secrets import redact
from low_bits_training.nn import rng as layer_rng
from low_bits_training.titan.checkpoint import fingerprint
from low_bits_training.titan.numerics import NumericsConfig, extras_for
from low_bits_training.titan.profiling import ProfilingConfig


@dataclass(kw_only=True, slots=True)
class JobConfig:
    """``[job]``: where the config starts from and what the run is called."""

    base: str = "llama3:llama3_debugmodel"
    """Base config function, ``module:function``: a torchtitan model name (``llama3``), a dotted module with
    a ``config_registry`` (or the module itself), and a function in it returning a ``Trainer.Config``."""

    name: str = ""
    """Run name. Sets ``dump_folder`` to ``outputs/<name>`` unless ``dump_folder`` is given."""

    description: str = ""
    """Free text, kept with the run."""


def step_seed(base: int, step: int) -> int:
    """The global RNG seed of one training step: a 63-bit hash of (base seed, step)."""
    digest = hashlib.blake2b(f"{base}|{step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class LowBitsTrainer(Trainer):
    """torchtitan's Trainer; later sections (precision plan, numerics) hook in here."""

    def __init__(self, config: Config):
        super().__init__(config)
        if hasattr(self.checkpointer, "fingerprint"):  # a resume checks the checkpoint against this run
            self.checkpointer.fingerprint = fingerprint(config)
        # torchtitan seeded this rank (debug.seed; distinct per PP stage): every step's stream derives from it.
        self._rng_base_seed = torch.initial_seed()

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

        def to_dict(self) -> dict:
            # What torchtitan prints (debug.print_config), saves (debug.save_config_file) and sends to W&B.
            return redact(Trainer.Config.to_dict(self))

        def __post_init__(self) -> None:
            Trainer.Config.__post_init__(self)
            self.numerics.check()
            self.profiling.check()

    def train_step(self, data_iterator):
        """torchtitan's step between the numerics / profiling bookkeeping (see titan/numerics.py).

        The random streams are reseeded from (base seed, step) first: the quantized layers' stochastic
        rounding stream (nn/rng.py) and the global RNG (dropout, if a model has any). A resumed run then draws
        the same numbers as an uninterrupted one, with no RNG state to checkpoint and under any resharding.
        """
        seed = step_seed(self._rng_base_seed, self.step)
        torch.manual_seed(seed)
        layer_rng.set_step_seed(seed)
        with extras_for(self).step(self.step):
            super().train_step(data_iterator)

    def forward_backward_step(self, **kwargs):
        """torchtitan's microbatch, then the loss / gradient / operand NaN checks and their policy."""
        return extras_for(self).after_microbatch(super().forward_backward_step(**kwargs))
