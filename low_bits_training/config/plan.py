"""The precision plan: ``[quantize]`` (recipe, backend, skip, rules) -> one ``LinearPlan`` per linear layer.

Resolution, in order: the recipe sets every role of every layer; each ``[[quantize.rules]]`` entry then
changes the roles it names in the layers it selects; ``skip`` puts whole layers back in high precision; the
backend is chosen per GEMM. Every mistake is a one-line ``ConfigError`` raised here, before the model is built.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from dataclasses import dataclass, field

from low_bits_training.config.tree import ConfigError
from low_bits_training.formats import QuantSpec, check_divisible
from low_bits_training.nn import GEMM_OPERANDS, GEMMS, ROLE_NAMES, ROLES, LinearPlan, device_has_fp8_gemm
from low_bits_training.nn import unsupported_reason as kernel_unsupported

from .recipes import RECIPES

BACKENDS = ("emulate", "real", "auto")
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
)


@dataclass(kw_only=True, slots=True)
class QuantRule:
    """``[[quantize.rules]]``: change some roles of some layers (applied after the recipe, in order)."""

    layers: list[str] = field(default_factory=list)
    """Globs over linear-layer FQNs (``layers.*.attention.*``, ``layers.0.*``, ``lm_head``). With first_n and
    last_n all empty the rule selects every layer."""
    first_n: int = 0
    """Also select every linear of the first N transformer blocks (``layers.0`` .. ``layers.N-1``)."""
    last_n: int = 0
    """Also select every linear of the last N transformer blocks."""
    roles: list[str] = field(default_factory=lambda: ["*"])
    """Globs over roles: ``forward.input``, ``forward.weight``, ``dgrad.grad_output``, ``dgrad.weight``,
    ``wgrad.grad_output``, ``wgrad.input``; e.g. ``wgrad.*``, ``*.weight``, ``*``."""
    format: str | None = None
    """Element format (``e4m3``, ``e2m1``, ``int8``, ...) or ``"high"`` for high precision. Unset: keep the
    current format and change only the fields given below."""
    scaling: str | None = None
    """QuantSpec.scaling: none | tensor | axis | block | tile (the axis is the GEMM's contraction dim)."""
    block_size: int | None = None
    """QuantSpec.block_size (block length / tile side)."""
    scale_format: str | None = None
    """QuantSpec.scale_format: fp32 | bf16 | e8m0 | ue4m3."""
    scale_rounding: str | None = None
    """QuantSpec.scale_rounding: exact | floor | ceil | rceil."""
    rounding: str | None = None
    """QuantSpec.rounding: nearest | stochastic | toward_zero."""
    saturate: bool | None = None
    """QuantSpec.saturate."""
    margin: int | None = None
    """QuantSpec.margin (power-of-two headroom)."""
    tensor_scale: bool | None = None
    """QuantSpec.tensor_scale (two-level scaling, NVFP4)."""


@dataclass(kw_only=True, slots=True)
class QuantizeConfig:
    """``[quantize]``: which number format each GEMM operand of each linear layer uses."""

    recipe: str = "bf16"
    """Named recipe for every layer: bf16 (no quantization), fp8_tensorwise, fp8_rowwise, fp8_rowwise_hp_wgrad,
    deepseek_fp8, mxfp8, mxfp6, mxfp4, nvfp4, int8 (see docs/precision_plan.md)."""
    backend: str = "emulate"
    """emulate (fake-quantize + fp32 matmul, any device), real (hardware kernels; an error where there are
    none), auto (real where the hardware has a kernel for a GEMM, else emulate; logged)."""
    skip: list[str] = field(default_factory=lambda: ["lm_head"])
    """FQN globs of layers kept entirely in high precision (applied after the rules). Default: the output
    projection, as torchao and Transformer Engine do."""
    rules: list[QuantRule] = field(default_factory=list)
    """Overrides applied after the recipe, in order."""


@dataclass(frozen=True)
class LayerShape:
    """What validation needs to know about one linear layer."""

    in_features: int
    out_features: int
    tokens_multiple: int = 1
    """The token count M is always a multiple of this (the sequence length)."""
    tp: int = 1
    """Tensor-parallel degree: block/tile scales must also fit a 1/tp shard of each feature dim."""


def _block_ids(fqns: list[str]) -> list[int]:
    return sorted({int(m.group(1)) for f in fqns if (m := re.match(r"layers\.(\d+)\.", f))})


def select_layers(rule: QuantRule, fqns: list[str], where: str) -> list[str]:
    """The FQNs a rule selects.

    Raises:
        ConfigError: a glob or first_n/last_n that selects nothing.
    """
    ids = _block_ids(fqns)
    if rule.first_n < 0 or rule.last_n < 0 or max(rule.first_n, rule.last_n) > len(ids):
        raise ConfigError(f"{where}.first_n/last_n = {rule.first_n}/{rule.last_n}: expected 0..{len(ids)}")
    blocks = set(ids[: rule.first_n]) | (set(ids[-rule.last_n :]) if rule.last_n else set())
    globs = rule.layers or ([] if blocks else ["*"])
    for g in globs:
        if not fnmatch.filter(fqns, g):
            raise ConfigError(f"{where}.layers: {g!r} matches no linear layer; layers are {', '.join(fqns)}")
    in_block = {f for f in fqns if (m := re.match(r"layers\.(\d+)\.", f)) and int(m.group(1)) in blocks}
    return [f for f in fqns if f in in_block or any(fnmatch.fnmatchcase(f, g) for g in globs)]


def select_roles(patterns: list[str], where: str) -> list[str]:
    """Role names matching any glob. Raises ConfigError for a glob that matches no role."""
    for p in patterns:
        if not fnmatch.filter(ROLE_NAMES, p):
            raise ConfigError(f"{where}.roles: {p!r} matches no role; roles are {', '.join(ROLE_NAMES)}")
    return [r for r in ROLE_NAMES if any(fnmatch.fnmatchcase(r, p) for p in patterns)]


def rule_spec(rule: QuantRule, current: QuantSpec | None, where: str) -> QuantSpec | None:
    """The spec a rule turns ``current`` into (None: high precision).

    Raises:
        ConfigError: an invalid field value (QuantSpec's own message, prefixed with the rule's key).
    """
    if rule.format == HIGH:
        return None
    changes = {k: getattr(rule, k) for k in _SPEC_FIELDS if getattr(rule, k) is not None}
    try:
        if rule.format is not None:
            base = dataclasses.asdict(current) if current is not None else {}
            base.update(format=rule.format, **changes)
            return QuantSpec(**base)
        return None if current is None else dataclasses.replace(current, **changes)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {str(e).splitlines()[0]}") from None


def _apply_rules(cfg: QuantizeConfig, fqns: list[str]) -> dict[str, dict[str, QuantSpec | None]]:
    try:
        from .recipes import recipe_specs

        base = recipe_specs(cfg.recipe)
    except KeyError as e:
        raise ConfigError(e.args[0]) from None
    table = {f: dict(base) for f in fqns}
    for i, rule in enumerate(cfg.rules):
        where = f"quantize.rules[{i}]"
        roles = select_roles(rule.roles, where)
        for f in select_layers(rule, fqns, where):
            for r in roles:
                table[f][r] = rule_spec(rule, table[f][r], where)
    for g in cfg.skip:
        if not fnmatch.filter(fqns, g):
            raise ConfigError(f"quantize.skip: {g!r} matches no linear layer; layers are {', '.join(fqns)}")
        for f in fnmatch.filter(fqns, g):
            table[f] = dict.fromkeys(ROLE_NAMES)
    return table


def choose_backends(specs: tuple, backend: str, fqn: str, device: str) -> tuple[str, ...]:
    """Backend per GEMM for one layer (see ``QuantizeConfig.backend``).

    Raises:
        ConfigError: backend "real" for a GEMM no real kernel can run.
    """
    out = []
    for gemm in GEMMS:
        op = GEMM_OPERANDS[gemm]
        sa, sb = specs[op.a], specs[op.b]
        reason = kernel_unsupported(sa, sb) if sa is not None or sb is not None else "high precision"
        if backend == "real" and sa is None and sb is None:
            out.append("emulate")  # nothing to quantize: a plain matmul
        elif backend == "real" and reason:
            raise ConfigError(
                f"quantize.backend = 'real': {fqn} {gemm} GEMM has no real kernel ({reason}); "
                "allowed: 'emulate', 'auto'"
            )
        else:
            real = backend == "real" or (backend == "auto" and not reason and device_has_fp8_gemm(device))
            out.append("real" if real else "emulate")
    return tuple(out)


def _check_shapes(plan: LinearPlan, fqn: str, shape: LayerShape) -> None:
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
                raise ConfigError(f"quantize: {fqn} {role.name} {s} ({spec}): {e}") from None


def resolve_plan(
    cfg: QuantizeConfig, layers: dict[str, LayerShape], device: str = "cpu"
) -> dict[str, LinearPlan]:
    """The full plan: one ``LinearPlan`` per linear layer FQN.

    Args:
        cfg: the ``[quantize]`` section.
        layers: FQN -> shape of every linear layer the model will build.
        device: where it will run ("cpu", "cuda"), for backend "auto".

    Returns:
        FQN -> LinearPlan (every layer, high-precision ones included).

    Raises:
        ConfigError: unknown recipe/backend/format/role, a glob that matches nothing, "real" without a
            kernel, or a block size that does not divide a dimension.
    """
    if cfg.backend not in BACKENDS:
        raise ConfigError(f"quantize.backend = {cfg.backend!r}: expected one of {', '.join(BACKENDS)}")
    table = _apply_rules(cfg, list(layers))
    plans = {}
    for fqn, by_role in table.items():
        specs = tuple(by_role[r] for r in ROLE_NAMES)
        plans[fqn] = LinearPlan(specs, choose_backends(specs, cfg.backend, fqn, device))
        _check_shapes(plans[fqn], fqn, layers[fqn])
    return plans


__all__ = ["RECIPES", "LayerShape", "QuantRule", "QuantizeConfig", "resolve_plan"]
