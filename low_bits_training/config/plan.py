"""The precision plan: ``[quantize]`` (recipe, backend, skip, rules) -> one ``LinearPlan`` per linear layer.

Resolution, in order: the recipe sets every role of every layer; each ``[[quantize.rules]]`` entry then
changes the roles it names in the layers it selects; ``skip`` puts whole layers back in high precision; the
backend is chosen per GEMM from the plan and the hardware (``config.backends``). Every mistake is a one-line ``ConfigError`` raised here, before the model is built.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from low_bits_training.config.autopilot import AutopilotConfig
from low_bits_training.config.comm import CommConfig
from low_bits_training.config.saved import SavedRule
from low_bits_training.config.section import AtLeast, Retired, Section
from low_bits_training.config.tree import ConfigError
from low_bits_training.formats import QuantSpec, check_divisible
from low_bits_training.formats.spec import (
    AmaxCompute,
    FourOverSix,
    InfAmax,
    RoundingMode,
    ScaleFormat,
    ScaleMin,
    ScaleRounding,
    Scaling,
    Source,
)
from low_bits_training.nn import ROLE_NAMES, ROLES, LinearPlan

from .attention import check_product_shapes, named_products
from .backends import (
    REAL_RETIRED,
    BackendSetting,
    Hardware,
    TorchaoOptions,
    check_backend_setting,
    check_torchao_options,
    check_torchao_runs,
    layer_backends,
)
from .operand_options import check_layer_options, grouped_specs
from .recipes import RECIPES, RecipeName

HIGH = "high"
_SPEC_FIELDS = (
    "scaling",
    "block_size",
    "scale_format",
    "scale_rounding",
    "rounding",
    "saturate",
    "margin",
    "tensor_scale",
    "scale_min",
    "inf_amax",
    "four_over_six",
    "amax_history",
    "amax_compute",
    "rht",
    "rht_seed",
    "source",
)


@dataclass(kw_only=True, slots=True)
class QuantRule(Section):
    """``[[quantize.rules]]``: change some roles of some layers (applied after the recipe, in order).

    A ``Section``: each field is checked when the rule is built (as ``quantize.rules.<key>``; from TOML, and
    inside a ``QuantizeConfig``, under its own index: ``quantize.rules[0].<key>``). What needs the layers or
    the recipe (globs, first_n beyond the blocks, the specs it makes) is checked by ``resolve_plan``.
    """

    SECTION: ClassVar[str] = "quantize.rules"

    layers: list[str] = field(default_factory=list)
    """Globs over linear-layer FQNs (``layers.*.attention.*``, ``layers.0.*``, ``lm_head``). With first_n and
    last_n all empty the rule selects every layer. The attention products (``layers.*.attention.qk`` /
    ``.pv``) are reached only by a glob that matches no linear layer (``config.attention``)."""
    first_n: Annotated[int, AtLeast(0)] = 0
    """Also select every linear of the first N transformer blocks (``layers.0`` .. ``layers.N-1``)."""
    last_n: Annotated[int, AtLeast(0)] = 0
    """Also select every linear of the last N transformer blocks."""
    roles: list[str] = field(default_factory=lambda: ["*"])
    """Globs over roles: ``forward.input``, ``forward.weight``, ``dgrad.grad_output``, ``dgrad.weight``,
    ``wgrad.grad_output``, ``wgrad.input``; e.g. ``wgrad.*``, ``*.weight``, ``*``."""
    format: str | None = None
    """Element format (``e4m3``, ``e2m1``, ``int8``, ...) or ``"high"`` for high precision. Unset: keep the
    current format and change only the fields given below."""
    scaling: Scaling | None = None
    """QuantSpec.scaling: none | tensor | axis | block | tile (the axis is the GEMM's contraction dim)."""
    block_size: Annotated[int | None, AtLeast(1)] = None
    """QuantSpec.block_size (block length / tile side)."""
    scale_format: ScaleFormat | None = None
    """QuantSpec.scale_format: fp32 | bf16 | e8m0 | ue4m3."""
    scale_rounding: ScaleRounding | None = None
    """QuantSpec.scale_rounding: exact | floor | ceil | rceil."""
    rounding: RoundingMode | None = None
    """QuantSpec.rounding: nearest | stochastic | toward_zero."""
    saturate: bool | None = None
    """QuantSpec.saturate."""
    margin: int | None = None
    """QuantSpec.margin (power-of-two headroom)."""
    tensor_scale: bool | None = None
    """QuantSpec.tensor_scale (two-level scaling, NVFP4)."""
    scale_min: ScaleMin | None = None
    """QuantSpec.scale_min: subnormal | normal (smallest scale kept; "normal" is torchao's NVFP4 floor)."""
    inf_amax: InfAmax | None = None
    """QuantSpec.inf_amax: keep | nan (a group with an infinite amax; "nan" is torchao's fp8 behaviour)."""
    four_over_six: FourOverSix | None = None
    """QuantSpec.four_over_six: off | mse | mae (NVFP4 4over6 adaptive block scaling; e2m1 blocks/tiles)."""
    amax_history: Annotated[int | None, AtLeast(0)] = None
    """QuantSpec.amax_history: 0 (current scaling) or N > 0 (delayed scaling from the last N amaxes; tensor)."""
    amax_compute: AmaxCompute | None = None
    """QuantSpec.amax_compute: max | most_recent (delayed scaling: the amax taken from the history)."""
    rht: Annotated[int | None, AtLeast(0)] = None
    """QuantSpec.rht: 0 or the size of a random Hadamard transform along the GEMM's contraction dim (set it on
    both operands of a GEMM, e.g. roles = ["wgrad.*"])."""
    rht_seed: Annotated[int | None, AtLeast(0)] = None
    """QuantSpec.rht_seed: seed of the RHT's sign vector."""
    source: Source | None = None
    """QuantSpec.source: high | forward (dgrad.weight / wgrad.input cast from the forward GEMM's cast)."""


@dataclass(kw_only=True, slots=True)
class PlanChange(Section):
    """``[quantize.eval]`` and the body of each ``[[quantize.phases]]`` entry: the ``[quantize]`` plan with
    the keys given here replaced; a key left out keeps the base's (config/schedule.py resolves it)."""

    SECTION: ClassVar[str] = "quantize.eval"

    recipe: RecipeName | None = None
    """The recipe of this plan (unset: ``[quantize] recipe``)."""
    rules: list[QuantRule] | None = None
    """Rules replacing ``[[quantize.rules]]`` in this plan (unset: the base's rules)."""
    skip: list[str] | None = None
    """Layers kept in high precision, replacing ``[quantize] skip`` in this plan (unset: the base's)."""


@dataclass(kw_only=True, slots=True)
class Phase(PlanChange):
    """``[[quantize.phases]]``: from ``start`` on, training uses this plan (until the next phase)."""

    SECTION: ClassVar[str] = "quantize.phases"

    start: int | float = -1
    """Where the phase begins: an int counts the steps before it (900: from step 901 on), a float in [0, 1)
    is a fraction of ``training.steps`` (0.9 of 1000 steps: from step 901 on)."""


@dataclass(kw_only=True, slots=True)
class QuantizeConfig(Section):
    """``[quantize]``: which number format each GEMM operand of each linear layer uses.

    A ``Section``: every field, those of its rules, phases, eval plan and comm tables included, is checked
    when it is built; ``resolve_plan`` checks what needs the model's layers and the hardware.
    """

    SECTION: ClassVar[str] = "quantize"

    recipe: RecipeName = "bf16"
    """Named recipe for every layer: bf16 (no quantization), fp8_tensorwise, fp8_rowwise, fp8_rowwise_hp_wgrad,
    deepseek_fp8, mxfp8, mxfp6, mxfp4, nvfp4, int8 (see docs/precision_plan.md)."""
    backend: Annotated[BackendSetting, Retired("real", REAL_RETIRED)] = "auto"
    """auto (torchao's module with its hardware kernel for every layer whose plan torchao has and whose
    device has the kernel, our emulation for the rest), torchao (torchao's module for every layer whose plan
    it has: its kernel where the device has one, else torchao's emulated mode), emulate (our fake-quantize +
    fp32 matmul everywhere). See docs/precision_plan.md."""
    skip: list[str] = field(default_factory=lambda: ["lm_head"])
    """FQN globs of layers kept entirely in high precision (applied after the rules). Default: the output
    projection, as torchao and Transformer Engine do."""
    rules: list[QuantRule] = field(default_factory=list)
    """Overrides applied after the recipe, in order."""
    torchao: TorchaoOptions = field(default_factory=TorchaoOptions)
    """torchao's own options for the layers the torchao backend runs (fp8 all-gather, cast kernels, ...)."""
    phases: list[Phase] = field(default_factory=list)
    """Precision schedule: plans that take over from a step on, in order (config/schedule.py)."""
    eval: PlanChange = field(default_factory=PlanChange)
    """``[quantize.eval]``: the plan of evaluation (torchtitan's validator); empty: the training plan of the
    step it runs after."""
    comm: CommConfig = field(default_factory=CommConfig)
    """``[quantize.comm]``: low-bit FSDP2 weight all-gather and gradient reduce-scatter (config/comm.py)."""
    saved: list[SavedRule] = field(default_factory=list)
    """``[[quantize.saved]]``: the format of what chosen modules save for the backward (config/saved.py)."""
    autopilot: AutopilotConfig = field(default_factory=AutopilotConfig)
    """``[quantize.autopilot]``: promote a failing role of a layer up a ladder during the run
    (config/autopilot.py)."""


TargetKind = Literal["linear", "router", "experts", "qk", "pv"]
"""What a plan entry is: a linear layer, an MoE router gate (a linear kept high unless a rule names it), one
stacked weight of an MoE experts module, or an attention product (``S = Q K^T`` / ``O = P V``)."""
NAMED_ONLY: frozenset[str] = frozenset({"router", "qk", "pv"})
"""Kinds that start in high precision whatever the recipe; only a rule whose ``layers`` glob names them (and
no entry of another kind) reaches them (``config.attention.named_products``)."""


@dataclass(frozen=True)
class LayerShape:
    """What validation needs to know about one plan entry (a GEMM target)."""

    in_features: int
    out_features: int
    tokens_multiple: int = 1
    """The token count M is always a multiple of this (the sequence length; 0 for expert weights: the
    dispatcher pads each expert's tokens to what the plan's blocks need)."""
    tp: int = 1
    """Tensor-parallel degree: block/tile scales must also fit a 1/tp shard of each feature dim."""
    kind: TargetKind = "linear"
    """What the entry is (see ``TargetKind``)."""
    copies: int = 1
    """How many times its GEMMs run per token: the query heads of an attention product, the experts each
    token is routed to (``top_k``) of an expert weight (the report's FLOP shares)."""

    @property
    def grouped(self) -> bool:
        """An MoE expert weight (a grouped GEMM per expert): torchao's grouped recipes apply, not its linears'."""
        return self.kind == "experts"

    @property
    def product(self) -> str:
        """``qk`` / ``pv`` for an attention product (``config.attention``: always emulated); else empty."""
        return self.kind if self.kind in ("qk", "pv") else ""

    @property
    def named_only(self) -> bool:
        """High precision unless a rule names it (``NAMED_ONLY``)."""
        return self.kind in NAMED_ONLY


def _block_ids(fqns: list[str]) -> list[int]:
    return sorted({int(m.group(1)) for f in fqns if (m := re.match(r"layers\.(\d+)\.", f))})


def check_glob(
    glob: str, fqns: list[str], converted: dict[str, str], where: str, may_be_converted: bool
) -> None:
    """A layer glob must match a layer the plan covers (or, for ``skip``, one a torchtitan converter swapped).

    Raises:
        ConfigError: it matches no linear layer, or (``may_be_converted`` False) only converted ones.
    """
    if fnmatch.filter(fqns, glob):
        return
    hits = fnmatch.filter(list(converted), glob)
    if hits and not may_be_converted:
        kinds = ", ".join(sorted({converted[h] for h in hits}))
        raise ConfigError(
            f"{where}: {glob!r} matches only layers the base's torchtitan converter already swapped ({kinds}: "
            f"{', '.join(hits[:4])}{' ...' if len(hits) > 4 else ''}); [quantize] cannot change them"
        )
    if not hits:
        names = ", ".join([*fqns, *converted])
        raise ConfigError(f"{where}: {glob!r} matches no linear layer; layers are {names}")


def select_layers(
    rule: QuantRule,
    fqns: list[str],
    where: str,
    converted: dict[str, str] | None = None,
    products: set[str] = frozenset(),
) -> list[str]:
    """The FQNs (among ``fqns``, the layers the plan covers) a rule selects.

    ``products`` (attention products among ``fqns``) are selected only by globs that name them
    (``config.attention.named_products``).

    Raises:
        ConfigError: a glob or first_n/last_n that selects nothing (see ``check_glob``).
    """
    named = named_products(rule.layers, fqns, products)
    fqns = [f for f in fqns if f not in products] if products else fqns
    ids = _block_ids(fqns)
    if rule.first_n < 0 or rule.last_n < 0 or max(rule.first_n, rule.last_n) > len(ids):
        raise ConfigError(f"{where}.first_n/last_n = {rule.first_n}/{rule.last_n}: expected 0..{len(ids)}")
    blocks = set(ids[: rule.first_n]) | (set(ids[-rule.last_n :]) if rule.last_n else set())
    globs = rule.layers or ([] if blocks else ["*"])
    for g in rule.layers:
        check_glob(g, [*fqns, *named], converted or {}, f"{where}.layers", may_be_converted=False)
    in_block = {f for f in fqns if (m := re.match(r"layers\.(\d+)\.", f)) and int(m.group(1)) in blocks}
    linears = [f for f in fqns if f in in_block or any(fnmatch.fnmatchcase(f, g) for g in globs)]
    return linears + named


def select_roles(patterns: list[str], where: str) -> list[str]:
    """Role names matching any glob. Raises ConfigError for a glob that matches no role."""
    for p in patterns:
        if not fnmatch.filter(ROLE_NAMES, p):
            raise ConfigError(f"{where}.roles: {p!r} matches no role; roles are {', '.join(ROLE_NAMES)}")
    return [r for r in ROLE_NAMES if any(fnmatch.fnmatchcase(r, p) for p in patterns)]


_BOUND_OPTIONS = {"four_over_six": "off", "amax_history": 0}
"""Options a spec holds only with some formats / scalings (4over6: e2m1 blocks; delayed: tensor scaling)."""


def rule_spec(rule: QuantRule, current: QuantSpec | None, where: str) -> QuantSpec | None:
    """The spec a rule turns ``current`` into (None: high precision).

    A rule that sets ``format`` keeps the fields of ``current`` it leaves unset, except the options bound to
    a format or scaling (``_BOUND_OPTIONS``) that the new spec cannot hold: those fall back to their
    defaults, so a preset's rule ("these layers in e4m3 blocks") composes with any recipe (nvfp4_4over6,
    fp8_delayed). An option the rule itself sets is never dropped.

    Raises:
        ConfigError: an invalid field value (QuantSpec's own message, prefixed with the rule's key).
    """
    if rule.format == HIGH:
        return None
    changes = {k: getattr(rule, k) for k in _SPEC_FIELDS if getattr(rule, k) is not None}
    try:
        if rule.format is None:
            return None if current is None else dataclasses.replace(current, **changes)
        base = dataclasses.asdict(current) if current is not None else {}
        base.update(format=rule.format, **changes)
        try:
            return QuantSpec(**base)
        except ValueError:
            inherited = {k: v for k, v in _BOUND_OPTIONS.items() if k not in changes}
            if not inherited or all(base.get(k, v) == v for k, v in inherited.items()):
                raise
            return QuantSpec(**{**base, **inherited})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {str(e).splitlines()[0]}") from None


def _apply_rules(
    cfg: QuantizeConfig,
    fqns: list[str],
    converted: dict[str, str],
    where: str = "quantize",
    products: set[str] = frozenset(),
    experts: set[str] = frozenset(),
) -> dict[str, dict[str, QuantSpec | None]]:
    try:
        from .recipes import recipe_specs

        base = recipe_specs(cfg.recipe)
    except KeyError as e:
        raise ConfigError(e.args[0]) from None
    grouped = grouped_specs(base)  # expert weights: without the options their grouped GEMM lacks
    table = {
        f: dict.fromkeys(ROLE_NAMES) if f in products else dict(grouped if f in experts else base)
        for f in fqns
    }
    for i, rule in enumerate(cfg.rules):
        at = f"{where}.rules[{i}]"
        roles = select_roles(rule.roles, at)
        for f in select_layers(rule, fqns, at, converted, products):
            for r in roles:
                table[f][r] = rule_spec(rule, table[f][r], at)
    for g in cfg.skip:
        # A skip glob may name layers the base's converter swapped (the default "lm_head" often does): they
        # keep the converter's numerics, and the plan table says so.
        check_glob(g, fqns, converted, f"{where}.skip", may_be_converted=True)
        for f in fnmatch.filter(fqns, g):
            table[f] = dict.fromkeys(ROLE_NAMES)
    return table


def _check_shapes(plan: LinearPlan, fqn: str, shape: LayerShape, where: str = "quantize") -> None:
    m, n, k = shape.tokens_multiple, shape.out_features, shape.in_features
    dims = {"input": (m, k), "weight": (n, k), "grad_output": (m, n)}
    for role, spec in zip(ROLES, plan.specs, strict=True):
        if spec is None or spec.scaling not in ("block", "tile"):
            continue
        a, b = dims[role.operand]
        local = {(a // shape.tp, b), (a, b // shape.tp)} if role.operand == "weight" else {(a, b // shape.tp)}
        for s in {(a, b), *local}:
            try:
                check_divisible(s, spec)
            except ValueError as e:
                raise ConfigError(f"{where}: {fqn} {role.name} {s} ({spec}): {e}") from None


def _rule_key(cfg: QuantizeConfig, fqn: str, role: str, layers: dict, where: str) -> str:
    """The TOML key of the last rule that set ``role`` of ``fqn`` (``where`` if none did)."""
    products = {f for f, s in layers.items() if s.named_only}
    for i in reversed(range(len(cfg.rules))):
        rule, at = cfg.rules[i], f"{where}.rules[{i}]"
        chosen = select_layers(rule, list(layers), at, None, products)
        if role in select_roles(rule.roles, at) and fqn in chosen:
            return at
    return where


def resolve_plan(
    cfg: QuantizeConfig,
    layers: dict[str, LayerShape],
    hw: Hardware | None = None,
    converted: dict[str, str] | None = None,
    where: str = "quantize",
) -> dict[str, LinearPlan]:
    """The full plan: one ``LinearPlan`` per linear layer FQN, numerics and backend per GEMM.

    Args:
        cfg: the ``[quantize]`` section.
        layers: FQN -> shape of every linear layer the plan covers.
        hw: the hardware it will run on (backend choice, see ``config.backends``); default: a CPU.
        converted: FQN -> module name of layers the base's own torchtitan converters already swapped (not
            covered: ``skip`` may name them, rules may not).
        where: the TOML key errors name for ``cfg`` (a schedule's phase: ``quantize.phases[0]``).

    Returns:
        FQN -> LinearPlan for every covered layer (high-precision ones included).

    Raises:
        ConfigError: unknown recipe/backend/format/role, a glob that matches nothing (or a rule that
            selects only converted layers), torchao options that cannot hold, or a block size that does not
            divide a dimension.
    """
    hw = hw or Hardware()
    check_backend_setting(cfg.backend, hw)
    products = {f for f, s in layers.items() if s.named_only}  # router gates, attention products
    experts = {f for f, s in layers.items() if s.grouped}
    table = _apply_rules(cfg, list(layers), converted or {}, where, products, experts)
    plans = {}
    for fqn, by_role in table.items():
        specs, shape = tuple(by_role[r] for r in ROLE_NAMES), layers[fqn]
        check_layer_options(fqn, specs, shape, where)  # RHT / source / delayed (config/operand_options.py)
        if shape.product:  # attention: emulated only, sizes named by head_dim / seq_len (config/attention.py)
            check_product_shapes(specs, fqn, shape, lambda r, f=fqn: _rule_key(cfg, f, r, layers, where))
            plans[fqn] = LinearPlan(specs)
            continue
        backends = layer_backends(
            LinearPlan(specs), cfg.backend, hw, shape.in_features, shape.out_features, shape.tp, shape.grouped
        )
        plans[fqn] = LinearPlan(specs, backends)
        _check_shapes(plans[fqn], fqn, shape, where)
    check_torchao_options(cfg.torchao, plans)
    check_torchao_runs(cfg.backend, plans, layers, hw, where)
    return plans


__all__ = [
    "RECIPES",
    "Hardware",
    "LayerShape",
    "QuantRule",
    "QuantizeConfig",
    "TorchaoOptions",
    "resolve_plan",
]
