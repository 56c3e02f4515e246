"""Checks of the GEMM operand options of issue 13 (RHT, source, delayed scaling) against a layer: one line each.

The QuantSpec fields check themselves (``four_over_six`` needs e2m1 blocks, ``amax_history`` tensor scaling, an
RHT size a power of two); the combinations of a layer's roles are ``nn.roles.operand_problem`` (the same check
``LinearPlan`` makes); what depends on the layer's shape and placement is here:

- an RHT must divide its GEMM's contraction dim, whole and per tensor-parallel shard: K (forward), N (dgrad),
  the token count (wgrad: a multiple of the sequence length);
- MoE expert weights (``nn.grouped``) take none of the three (their grouped GEMM does not implement them): a
  rule that sets one on them is refused; a recipe's (nvfp4's wgrad RHT, fp8_delayed's amax history) is left
  out for them (``grouped_specs``: RHT off, current scaling, cast from high precision), as the plan table shows.

Delayed scaling under tensor parallelism needs no refusal: the current amax of a sharded operand is
all-reduced over its shards before it enters the history (``nn.cast``), as current scaling does.
"""

from __future__ import annotations

from low_bits_training.errors import ConfigError
from low_bits_training.formats import QuantSpec
from low_bits_training.nn import ROLES
from low_bits_training.nn.grouped import grouped_spec
from low_bits_training.nn.roles import operand_problem
from low_bits_training.plan.attention import contraction

_OPTIONS = ("rht", "source", "amax_history")


def _contraction(gemm: str, shape) -> tuple[str, int]:
    """(name, size) of a GEMM's contraction dim for a layer of this shape (tokens: the sequence length)."""
    if shape.product:  # an attention product: head_dim or seq_len (plan/attention.py)
        return contraction(shape, gemm)
    return {
        "forward": ("in_features", shape.in_features),
        "dgrad": ("out_features", shape.out_features),
        "wgrad": ("tokens: seq_len", shape.tokens_multiple),
    }[gemm]


def _set_options(spec: QuantSpec) -> list[str]:
    return [f"{o} = {getattr(spec, o)!r}" for o in _OPTIONS if getattr(spec, o) not in (0, "high")]


def grouped_specs(specs: dict[str, QuantSpec | None]) -> dict[str, QuantSpec | None]:
    """A recipe's role specs as MoE expert weights take them: the options their grouped GEMM lacks
    (``_OPTIONS``) set back to their defaults (``nn.grouped.grouped_spec``)."""
    return {r: grouped_spec(s) for r, s in specs.items()}


def check_layer_options(
    fqn: str, specs: tuple[QuantSpec | None, ...], shape, where: str = "quantize"
) -> None:
    """One layer's role specs against its shape (``plan.resolve.LayerShape``).

    Args:
        fqn: the layer.
        specs: its role specs (``ROLES`` order).
        shape: its ``LayerShape``.
        where: the TOML key the error names (``quantize``, a schedule phase ``quantize.phases[0]``).

    Raises:
        ConfigError: ``<where>: <fqn> <role>: <why>`` (see the module doc), before any model is built.
    """
    problem = operand_problem(specs, ("emulate",) * 3)
    if problem:
        raise ConfigError(f"{where}: {fqn} {problem}")
    for role, spec in zip(ROLES, specs, strict=True):
        if spec is None:
            continue
        if shape.grouped and _set_options(spec):  # a grouped-experts entry (titan/targets/experts.py)
            raise ConfigError(
                f"{where}: {fqn} {role.name}: {', '.join(_set_options(spec))} is not supported for MoE "
                "expert weights (grouped GEMM); exclude them with a rule on the attention/dense layers only"
            )
        if not spec.rht:
            continue
        name, size = _contraction(role.gemm, shape)
        for d in {size, size // max(1, shape.tp)}:
            if d % spec.rht:
                raise ConfigError(
                    f"{where}: {fqn} {role.name}: rht = {spec.rht} does not divide the {role.gemm} GEMM's "
                    f"contraction dim ({name} {size}{f', {d} per TP shard' if d != size else ''})"
                )
