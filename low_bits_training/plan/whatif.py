"""What-if statistics, resolved: which alternative formats, measured on which layers and roles.

    [numerics]
    stats_freq = 10
    whatif = ["nvfp4", "mxfp4", "e2m1_b8"]      # recipes, or names of whatif_specs tables
    whatif_layers = ["layers.*"]                # FQN globs (default: every linear the plan covers)
    whatif_roles = ["forward.*", "wgrad.*"]     # role globs (default: all six)

    [numerics.whatif_specs.e2m1_b8]             # a custom alternative: QuantSpec fields as in a rule
    format = "e2m1"
    scaling = "block"
    block_size = 8
    scale_format = "e8m0"

A recipe gives each role that recipe's spec (a role the recipe keeps high is not measured); a custom spec is
used for every selected role, blocked / row-scaled along the role's GEMM contraction dim (as a plan is).
"""

from __future__ import annotations

import dataclasses
import fnmatch

from low_bits_training.config.numerics import alternative
from low_bits_training.errors import ConfigError
from low_bits_training.formats import QuantSpec
from low_bits_training.nn import ROLE_NAMES, ROLES, LinearPlan
from low_bits_training.nn.whatif import WhatIf
from low_bits_training.plan.backends import TORCHAO_BACKENDS
from low_bits_training.plan.options import check_layer_options
from low_bits_training.plan.resolve import LayerShape, check_glob, check_shapes, select_roles


def check_fits(fqn: str, specs: tuple[QuantSpec | None, ...], shape: LayerShape, where: str) -> None:
    """Each alternative role spec fits the layer on its own (a what-if needs no partner operand to cancel an
    RHT against): blocks and tiles divide the operand, whole and per TP shard; an RHT divides the contraction dim.

    Raises:
        ConfigError: the plan's own one-line messages, named by ``where``.
    """
    plain = tuple(None if s is None else dataclasses.replace(s, rht=0, source="high") for s in specs)
    check_shapes(LinearPlan(plain), fqn, shape, where)
    for role, s in zip(ROLES, specs, strict=True):
        if (
            s is not None and s.rht
        ):  # both operands of its GEMM carry the same transform: only the size is checked
            paired = dataclasses.replace(s, source="high")
            check_layer_options(
                fqn, tuple(paired if r.gemm == role.gemm else None for r in ROLES), shape, where
            )


def resolve_whatif(
    cfg,
    fqns: list[str],
    strict: bool = True,
    layers: dict[str, LayerShape] | None = None,
    plans: dict[str, LinearPlan] | None = None,
) -> dict[str, WhatIf]:
    """The what-if table of every selected linear layer.

    Args:
        cfg: the ``[numerics]`` section (``whatif``, ``whatif_layers``, ``whatif_roles``, ``whatif_specs``).
        fqns: the linear layers to choose from.
        strict: refuse a layer glob that matches nothing (at config time; off on a pipeline stage, which holds
            only some layers).
        layers: shapes, to check each alternative's blocks fit (config time).
        plans: the resolved plan, to refuse layers torchao's modules run (config time).

    Returns:
        FQN -> ``WhatIf`` (layers with nothing to measure are left out); empty without ``whatif``.

    Raises:
        ConfigError: a glob that matches nothing, a block that does not fit, a layer torchao runs.
    """
    if not cfg.whatif:
        return {}
    roles = set(select_roles(cfg.whatif_roles, "numerics.whatif"))
    for g in cfg.whatif_layers if strict else ():
        check_glob(g, fqns, {}, "numerics.whatif_layers", may_be_converted=False)
    chosen = [f for f in fqns if any(fnmatch.fnmatchcase(f, g) for g in cfg.whatif_layers)]
    alts = {n: alternative(n, cfg.whatif_specs) for n in cfg.whatif}
    out = {}
    for fqn in chosen:
        if plans is not None and plans[fqn].backends[0] in TORCHAO_BACKENDS:
            raise ConfigError(
                f"numerics.whatif_layers: {fqn} runs on torchao's module, which records no statistics; set "
                "quantize.backend = 'emulate' or leave it out of numerics.whatif_layers"
            )
        table = {n: tuple(a[r] if r in roles else None for r in ROLE_NAMES) for n, a in alts.items()}
        table = {n: s for n, s in table.items() if any(x is not None for x in s)}
        if not table:
            continue
        for n, specs in table.items():
            if layers is not None:
                check_fits(fqn, specs, layers[fqn], f"numerics.whatif ({n})")
        out[fqn] = WhatIf(tuple(table), tuple(table.values()))
    return out
