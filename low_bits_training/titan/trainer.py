"""The torchtitan ``Trainer`` with the sections low-bits-training adds to its config tree."""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.trainer import Trainer

from low_bits_training.config.plan import QuantizeConfig
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


class LowBitsTrainer(Trainer):
    """torchtitan's Trainer; later sections (precision plan, numerics) hook in here."""

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

        def __post_init__(self) -> None:
            Trainer.Config.__post_init__(self)
            self.numerics.check()
            self.profiling.check()

    def train_step(self, data_iterator):
        """torchtitan's step between the numerics / profiling bookkeeping (see titan/numerics.py)."""
        with extras_for(self).step(self.step):
            super().train_step(data_iterator)

    def forward_backward_step(self, **kwargs):
        """torchtitan's microbatch, then the loss / gradient / operand NaN checks and their policy."""
        return extras_for(self).after_microbatch(super().forward_backward_step(**kwargs))
