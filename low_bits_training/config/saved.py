"""``[[quantize.saved]]``: the number format of what autograd keeps from the forward for the backward.

A rule selects modules of the model by FQN glob and gives the format every activation their forward saves
is kept in until the backward reads it (``nn.saved`` packs it into codes + scales; the backward gets the
decoded values). Parameters are never touched (they are held anyway), nor tensors of fewer than
``min_numel`` elements (norm and softmax statistics), nor integer / 1-byte tensors.

    [[quantize.saved]]
    modules = ["layers.*"]          # whole transformer blocks (the unit torch.compile compiles)
    format = "e4m3"                 # or "bf16" / "fp16" (a plain cast), any element format, "high"
    scaling = "axis"                # none | tensor | axis (a scale per row: the default) | block

A glob selects the outermost modules it matches (``layers.*`` the blocks, not their parts: those save
under their block's scope). Later rules win where they select the same module; a module inside a selected one that a rule also selects
uses its own rule for what it saves. Pure config: the model's module tree comes in as FQNs.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from low_bits_training.config.section import AtLeast, Section, checked_spec
from low_bits_training.errors import ConfigError
from low_bits_training.formats import HIGH, QuantSpec
from low_bits_training.formats.spec import ScaleFormat, ScaleRounding, spec_kwargs

CASTS = ("bf16", "fp16")
"""Formats kept as a plain torch dtype (no scales)."""
BLOCK = re.compile(r"layers\.\d+")
"""The modules torch.compile compiles one by one (torchtitan's ``apply_compile``: each transformer block)."""


@dataclass(kw_only=True, slots=True)
class SavedRule(Section):
    """``[[quantize.saved]]``: the format the saved activations of some modules are kept in."""

    SECTION: ClassVar[str] = "quantize.saved"

    modules: list[str] = field(default_factory=lambda: ["layers.*"])
    """Globs over module FQNs (``layers.*``, ``layers.*.feed_forward``, ``layers.0.attention``, ``norm``).
    Under ``compile.enable`` a rule may select only whole transformer blocks (``layers.N``): the hooks sit
    outside the compiled region and see the values the compiled graph saves."""
    format: str = "e4m3"
    """Element format (``e4m3``, ``e5m2``, ``int8``, ``e2m1``, ...), ``bf16`` / ``fp16`` (a plain cast), or
    ``high`` (kept as the forward made it, only counted; undoes an earlier rule)."""
    scaling: Literal["none", "tensor", "axis", "block"] = "axis"
    """none (values rounded as they are) | tensor (one scale) | axis (one scale per row of the last dim, the
    default: an outlier flattens only its own row) | block (1 x block_size groups along the last dim)."""
    block_size: Annotated[int, AtLeast(1)] = 32
    """Group length of ``block`` scaling; it must divide the last dim of what the selected modules save."""
    scale_format: ScaleFormat = "fp32"
    """fp32 | bf16 | e8m0 | ue4m3: the grid of the scales, and their storage (4, 2, 1, 1 bytes)."""
    scale_rounding: ScaleRounding = "exact"
    """exact | floor | ceil | rceil (see ``QuantSpec.scale_rounding``)."""
    rounding: Literal["nearest", "toward_zero"] = "nearest"
    """nearest | toward_zero (stochastic rounding of saves is not offered: its bits would need a key per
    save that a resume replays)."""
    saturate: bool = True
    """Overflow clamps to the format's largest value (False: the format's own inf / NaN)."""
    min_numel: Annotated[int, AtLeast(0)] = 4096
    """Tensors with fewer elements are kept as they are (statistics, small buffers)."""


@dataclass(frozen=True)
class SavedFormat:
    """What one module's saves are kept in: a spec (codes + scales), a plain dtype name, or neither (high)."""

    spec: QuantSpec | None
    cast: str | None
    min_numel: int
    rule: int
    """Index of the rule that chose it (``quantize.saved[i]``)."""

    @property
    def label(self) -> str:
        """Short name for tables and logs (``e4m3 tensor``, ``bf16``, ``high``)."""
        if self.cast:
            return self.cast
        return self.spec.short() if self.spec is not None else HIGH


def rule_format(rule: SavedRule, where: str) -> SavedFormat:
    """The format a rule asks for.

    Raises:
        ConfigError: a field the format cannot take (QuantSpec's own message under the rule's key).
    """
    fmt = rule.format.lower()
    if fmt == HIGH or fmt in CASTS:
        return SavedFormat(None, None if fmt == HIGH else fmt, rule.min_numel, 0)
    spec = checked_spec(where, fmt, **spec_kwargs(rule))  # the rule's QuantSpec fields
    if spec.elem.bits > 8:
        raise ConfigError(f"{where}.format = {rule.format!r}: a save is held in codes of <= 8 bits, or as "
                          f"{' / '.join(CASTS)}; use one of those or 'high'")  # fmt: skip
    return SavedFormat(spec, None, rule.min_numel, 0)


def resolve_saved(
    rules: list[SavedRule],
    modules: list[str],
    compiled: bool,
    last_dims: dict[str, set[int]],
) -> dict[str, SavedFormat]:
    """Module FQN -> the format its saves are kept in, for every module a rule selects ("high": kept as made,
    and counted in the ``saved/*`` metrics).

    Args:
        rules: ``quantize.saved``.
        modules: every module FQN of the model (the config tree's, model order).
        compiled: torch.compile compiles each transformer block (``compile.enable`` with ``model``).
        last_dims: module FQN -> the last dims of what it may save (its linears' in / out features, the
            attention head dim): a block size must divide each one.

    Raises:
        ConfigError: one line: a glob that selects no module, a module inside a compiled block, a block size
            that does not divide what a selected module saves, a bad format field.
    """
    chosen: dict[str, SavedFormat] = {}
    for i, rule in enumerate(rules):
        where = f"quantize.saved[{i}]"
        fmt = rule_format(rule, where)
        fmt = SavedFormat(fmt.spec, fmt.cast, fmt.min_numel, i)
        for glob in rule.modules:
            hits = [m for m in modules if m and fnmatch.fnmatchcase(m, glob)]
            outer = set(hits)  # a module inside a selected one saves under its scope already
            hits = [m for m in hits if not any(m.startswith(o + ".") for o in outer)]
            if not hits:
                shown = ", ".join([m for m in modules if m and not re.match(r"layers\.[1-9]", m)][:12])
                raise ConfigError(f"{where}.modules: {glob!r} matches no module; modules are {shown}, ...")
            inner = [m for m in hits if compiled and not BLOCK.fullmatch(m)]
            if inner:
                raise ConfigError(
                    f"{where}.modules: {glob!r} selects {inner[0]!r}, which is not a whole transformer block; "
                    "under compile.enable torch.compile compiles each block as one graph and a save format "
                    "applies to a block's saves (allowed: 'layers.*', 'layers.N'; or compile.enable = false)"
                )
            for m in hits:
                if fmt.spec is not None and fmt.spec.scaling == "block":
                    bad = sorted(d for d in last_dims.get(m, ()) if d % fmt.spec.block_size)
                    if bad:
                        raise ConfigError(
                            f"{where}.block_size = {fmt.spec.block_size}: {m!r} saves tensors whose last dim is "
                            f"{bad[0]}, which {fmt.spec.block_size}-element blocks do not divide; allowed: a "
                            f"divisor of {', '.join(map(str, sorted(last_dims[m])))}"
                        )
                chosen[m] = fmt
    return chosen
