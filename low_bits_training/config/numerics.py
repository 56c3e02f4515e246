"""``[numerics]``: the section's typed config (a ``Section``: checked when built)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from low_bits_training.config.section import AtLeast, Section

Policy = Literal["off", "warn", "skip", "stop"]


@dataclass(kw_only=True, slots=True)
class NumericsConfig(Section):
    """``[numerics]``: quantization statistics and what to do with NaN / Inf (see docs/numerics.md)."""

    SECTION: ClassVar[str] = "numerics"

    stats_freq: Annotated[int, AtLeast(0, "0: off")] = 0
    """Collect statistics of every quantized GEMM operand on step 1 and every ``stats_freq`` steps (0: off)."""
    nonfinite: Policy = "warn"
    """On a NaN / Inf in a GEMM operand or product, the loss or a gradient: "warn" (log step/module/role/
    rank), "skip" (also drop that optimizer step), "stop" (save the last good state if checkpointing is on,
    exit 3), "off" (no checks)."""
    log_layers: bool = False
    """Also send every layer's underflow / saturation / SQNR to TensorBoard / W&B (the JSONL has them all)."""
    whatif: list[str] = field(default_factory=list)
    """What-if statistics: formats measured on the live GEMM operands on statistics steps, beside the plan's
    own (recipe names: each role gets that recipe's spec; or names of ``[numerics.whatif_specs.<name>]``)."""
    whatif_layers: list[str] = field(default_factory=lambda: ["*"])
    """FQN globs of the linear layers that record what-if statistics (a layer the plan keeps in high
    precision becomes a QuantLinear with a high-precision plan: still exactly ``F.linear``)."""
    whatif_roles: list[str] = field(default_factory=lambda: ["*"])
    """Role globs measured (``forward.*``, ``wgrad.grad_output``, ...)."""
    whatif_specs: dict[str, Any] = field(default_factory=dict)
    """Custom what-if formats: name -> QuantSpec fields as in a rule (format, scaling, block_size, ...)."""

    def check(self) -> None:
        """Raises: ConfigError (one line) for a field that does not fit its type (``stats_freq >= 0``, a
        ``Policy``) or what-if names that do not resolve (``config.whatif.check_names``)."""
        Section.check(self)
        from low_bits_training.config.whatif import check_names

        check_names(self.whatif, self.whatif_specs, self.stats_freq)
