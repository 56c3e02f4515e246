"""The autopilot's ladder (``[quantize.autopilot] ladder``): the spec a role gets one rung up. A recipe rung
gives the role that recipe's spec for it, a format rung keeps the role's scaling, block and rounding and swaps
the element format, ``high`` ends quantization of that role (``config.autopilot.rung_kind`` names the kinds)."""

from __future__ import annotations

import dataclasses

from low_bits_training.config.autopilot import rung_kind
from low_bits_training.formats import HIGH, QuantSpec
from low_bits_training.nn import ROLE_NAMES, ROLES
from low_bits_training.nn.recipes import RECIPES
from low_bits_training.nn.roles import along_contraction


def rung_spec(rung: str, role: str, current: QuantSpec) -> QuantSpec | None:
    """The spec ``role`` gets on ``rung`` from ``current`` (None: high precision).

    Raises:
        ValueError: the rung's format cannot take the current spec's other fields.
    """
    kind = rung_kind(rung)
    if kind == HIGH:
        return None
    if kind == "recipe":
        return along_contraction(RECIPES[rung].get(role), ROLES[ROLE_NAMES.index(role)])
    return dataclasses.replace(current, format=rung)


def _on_rung(rung: str, role: str, spec: QuantSpec) -> bool:
    kind = rung_kind(rung)
    if kind == "recipe":
        return rung_spec(rung, role, spec) == spec
    return kind == "format" and spec.format == rung


def promote(spec: QuantSpec | None, role: str, ladder: list[str]) -> tuple[QuantSpec | None, str] | None:
    """The next spec up ``ladder`` for ``role`` now under ``spec``, and the rung's name.

    The rung above the highest rung ``spec`` is on (a spec on none goes to the top rung); a rung whose
    format cannot take the role's other fields is passed over.

    Returns:
        ``(spec, rung)``, or None when there is nothing above (already high, or on the top rung).
    """
    if spec is None:
        return None
    on = [i for i, rung in enumerate(ladder) if _on_rung(rung, role, spec)]
    start = on[-1] + 1 if on else len(ladder) - 1
    for rung in ladder[start:]:
        try:
            new = rung_spec(rung, role, spec)
        except (TypeError, ValueError):
            continue
        if new != spec:
            return new, rung
    return None
