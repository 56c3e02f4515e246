"""The autopilot's ladder (``[quantize.autopilot] ladder``), parsed once into typed rungs, and the spec a role
gets one rung up. A recipe rung gives the role that recipe's spec for it, a format rung keeps the role's
scaling, block and rounding and swaps the element format, ``high`` ends quantization of that role."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from low_bits_training.config.autopilot import rung_kind
from low_bits_training.formats import HIGH, QuantSpec
from low_bits_training.nn import ROLE_NAMES, ROLES
from low_bits_training.nn.recipes import RECIPES
from low_bits_training.nn.roles import along_contraction

RungKind = Literal["high", "recipe", "format"]


@dataclass(frozen=True)
class Rung:
    """One rung of the ladder: its name as the TOML gives it and what kind of name it is."""

    name: str
    kind: RungKind


def parse_ladder(names: list[str], where: str = "quantize.autopilot.ladder") -> tuple[Rung, ...]:
    """The typed rungs of ``[quantize.autopilot] ladder``, lowest first (the autopilot parses it once).

    Raises:
        ConfigError: a rung that names nothing (``config.autopilot.rung_kind``'s one line).
    """
    return tuple(Rung(n, rung_kind(n, f"{where}[{i}]")) for i, n in enumerate(names))


def rung_spec(rung: Rung, role: str, current: QuantSpec) -> QuantSpec | None:
    """The spec ``role`` gets on ``rung`` from ``current`` (None: high precision).

    Raises:
        ValueError: the rung's format cannot take the current spec's other fields.
    """
    if rung.kind == HIGH:
        return None
    if rung.kind == "recipe":
        return along_contraction(RECIPES[rung.name].get(role), ROLES[ROLE_NAMES.index(role)])
    return dataclasses.replace(current, format=rung.name)


def _on_rung(rung: Rung, role: str, spec: QuantSpec) -> bool:
    if rung.kind == "recipe":
        return rung_spec(rung, role, spec) == spec
    return rung.kind == "format" and spec.format == rung.name


def promote(
    spec: QuantSpec | None, role: str, ladder: tuple[Rung, ...]
) -> tuple[QuantSpec | None, str] | None:
    """The next spec up ``ladder`` for ``role`` now under ``spec``, and the rung's name.

    The rung above the highest rung ``spec`` is on (a spec on none goes to the top rung); a rung whose
    format cannot take the role's other fields is passed over.

    Returns:
        ``(spec, rung name)``, or None when there is nothing above (already high, or on the top rung).
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
            return new, rung.name
    return None
