"""The speed model's efficiency parameters: one set, fixed for every GPU and recipe (docs/speed_model.md says
how each value was chosen and what it is held against)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeedParams:
    """How far real kernels fall short of the datasheet. Frozen; the defaults are ``PARAMS``."""

    gemm_efficiency: float = 0.70
    """Fraction of the dtype's dense peak a large GEMM's multiply-adds reach (bf16, fp8, fp6, int8)."""
    fp4_efficiency: float = 0.62
    """fp4 GEMMs reach this fraction of ``gemm_efficiency``: the 4-bit tensor cores are the least fed."""
    kernel_overhead_us: float = 3.0
    """Fixed time per kernel (launch, ramp-up, tail wave), in microseconds: per GEMM and per cast pass.
    It is what makes the efficiency depend on size: a GEMM of ideal time t reaches t / (t + this)."""
    cast_bandwidth: float = 0.50
    """Fraction of HBM bandwidth a cast kernel (amax, scale, round, write) reaches."""
    nongemm_share: float = 0.30
    """Share of the bf16 step outside the GEMMs (norms, rotary, activations, softmax, the optimizer, exposed
    communication): a time that no plan changes."""

    def __post_init__(self) -> None:
        for name in ("gemm_efficiency", "fp4_efficiency", "cast_bandwidth"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"SpeedParams.{name}={getattr(self, name)!r}: expected a number in (0, 1]")
        if not 0.0 <= self.nongemm_share < 1.0:
            raise ValueError(f"SpeedParams.nongemm_share={self.nongemm_share!r}: expected a number in [0, 1)")
        if self.kernel_overhead_us < 0:
            raise ValueError(f"SpeedParams.kernel_overhead_us={self.kernel_overhead_us!r}: expected >= 0")


PARAMS = SpeedParams()
"""The one parameter set every prediction in the docs uses."""
