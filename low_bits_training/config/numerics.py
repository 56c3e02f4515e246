"""``[numerics]``: the section's typed config (a ``Section``: checked when built)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal

from low_bits_training.config.section import AtLeast, Section
from low_bits_training.config.tree import build_dataclass
from low_bits_training.errors import ConfigError
from low_bits_training.formats import QuantSpec
from low_bits_training.nn import ROLE_NAMES
from low_bits_training.nn.recipes import RECIPES, recipe_specs

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
        ``Policy``) or what-if names that do not resolve (``check_names``)."""
        Section.check(self)
        check_names(self.whatif, self.whatif_specs, self.stats_freq)


def custom_spec(name: str, table: Any) -> QuantSpec:
    """The QuantSpec of ``[numerics.whatif_specs.<name>]``.

    Raises:
        ConfigError: not a table, an ``axis`` key (the axis is always the GEMM's contraction dim), an unknown
            key or a value QuantSpec refuses.
    """
    where = f"numerics.whatif_specs.{name}"
    if not isinstance(table, dict):
        raise ConfigError(f"{where} = {table!r}: expected a table of QuantSpec fields (format = 'e2m1', ...)")
    if "axis" in table:
        raise ConfigError(f"{where}.axis: not a key; the axis is always the GEMM's contraction dim")
    return build_dataclass(QuantSpec, table, where)


def alternative(name: str, custom: dict[str, Any]) -> dict[str, QuantSpec | None]:
    """Role name -> spec of one alternative (a custom spec first, else the recipe of that name)."""
    if name in custom:
        return dict.fromkeys(ROLE_NAMES, custom_spec(name, custom[name]))
    return recipe_specs(name)


def check_names(names: list[str], custom: dict[str, Any], stats_freq: int) -> None:
    """The ``[numerics]`` what-if keys on their own (no model needed).

    Raises:
        ConfigError: an unknown or repeated name, a custom spec that is invalid or not listed, a recipe that
            measures nothing (bf16), or what-if without statistics steps.
    """
    for name in custom:
        custom_spec(name, custom[name])
        if name in RECIPES:
            raise ConfigError(
                f"numerics.whatif_specs.{name}: the name of a recipe; give the table another name"
            )
        if name not in names:
            raise ConfigError(f"numerics.whatif_specs.{name}: not listed in numerics.whatif = {names!r}")
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"numerics.whatif = {names!r}: {name!r} is listed twice")
        if name not in custom and name not in RECIPES:
            raise ConfigError(
                f"numerics.whatif = {names!r}: {name!r} is neither a recipe ({', '.join(RECIPES)}) nor a "
                "numerics.whatif_specs table"
            )
        if all(s is None for s in alternative(name, custom).values()):
            raise ConfigError(
                f"numerics.whatif = {names!r}: {name!r} keeps every role high; it measures nothing"
            )
    if names and not stats_freq:
        raise ConfigError(
            f"numerics.whatif = {names!r}: needs numerics.stats_freq > 0 (what-if statistics are recorded on "
            "statistics steps)"
        )
