"""The precision plan resolved: ``[quantize]`` (recipe, backend, skip, rules) -> one ``LinearPlan`` per target.

Resolution, in order: the recipe sets every role of every layer; each ``[[quantize.rules]]`` entry then
changes the roles it names in the layers it selects; ``skip`` puts whole layers back in high precision; the
backend is chosen per GEMM from the plan and the hardware (``plan.backends``). Every mistake is a one-line
``ConfigError`` raised here, before the model is built.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from dataclasses import dataclass
from typing import Literal

from low_bits_training.config.quantize import QuantizeConfig, QuantRule
from low_bits_training.errors import ConfigError
from low_bits_training.formats import HIGH, QuantSpec, check_divisible
from low_bits_training.formats.spec import spec_kwargs
from low_bits_training.nn import ROLE_NAMES, ROLES, LinearPlan
from low_bits_training.nn.hardware import Hardware
from low_bits_training.nn.recipes import recipe_specs
from low_bits_training.plan.attention import check_product_shapes, named_products
from low_bits_training.plan.backends import (
    check_backend_setting,
    check_torchao_options,
    check_torchao_runs,
    layer_backends,
)
from low_bits_training.plan.options import check_layer_options, grouped_specs

EntryKind = Literal["linear", "router", "experts", "qk", "pv"]
"""What a plan entry is: a linear layer, an MoE router gate (a linear kept high unless a rule names it), one
stacked weight of an MoE experts module, or an attention product (``S = Q K^T`` / ``O = P V``)."""
NAMED_ONLY: frozenset[str] = frozenset({"router", "qk", "pv"})
"""Kinds that start in high precision whatever the recipe; only a rule whose ``layers`` glob names them (and
no entry of another kind) reaches them (``plan.attention.named_products``)."""


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
    kind: EntryKind = "linear"
    """What the entry is (see ``EntryKind``)."""
    copies: int = 1
    """How many times its GEMMs run per token: the query heads of an attention product, the experts each
    token is routed to (``top_k``) of an expert weight (the report's FLOP shares)."""

    @property
    def grouped(self) -> bool:
        """An MoE expert weight (a grouped GEMM per expert): torchao's grouped recipes apply, not its linears'."""
        return self.kind == "experts"

    @property
    def product(self) -> str:
        """``qk`` / ``pv`` for an attention product (``plan.attention``: always emulated); else empty."""
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
    (``plan.attention.named_products``).

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


_BOUND_OPTIONS = {
    "four_over_six": "off",
    "amax_history": 0,
    "scale_underflow": "clamp",
    "scale_order": "decode",
}
"""Options a spec holds only with some formats / scalings (4over6: e2m1 blocks; delayed: tensor scaling;
Transformer Engine's zeroed underflow and encode-first order: exact two-level scales)."""


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
    changes = spec_kwargs(rule)  # config.quantize.RULE_SPEC_FIELDS, those the rule sets
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
    base = recipe_specs(cfg.recipe, f"{where}.recipe")
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


def check_shapes(plan: LinearPlan, fqn: str, shape: LayerShape, where: str = "quantize") -> None:
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
        hw: the hardware it will run on (backend choice, see ``plan.backends``); default: a CPU.
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
        check_layer_options(fqn, specs, shape, where)  # RHT / source / delayed (plan/options.py)
        if shape.product:  # attention: emulated only, sizes named by head_dim / seq_len (plan/attention.py)
            check_product_shapes(specs, fqn, shape, lambda r, f=fqn: _rule_key(cfg, f, r, layers, where))
            plans[fqn] = LinearPlan(specs)
            continue
        backends = layer_backends(
            LinearPlan(specs), cfg.backend, hw, shape.in_features, shape.out_features, shape.tp, shape.grouped
        )
        plans[fqn] = LinearPlan(specs, backends)
        check_shapes(plans[fqn], fqn, shape, where)
    check_torchao_options(cfg.torchao, plans)
    check_torchao_runs(cfg.backend, plans, layers, hw, where)
    return plans
