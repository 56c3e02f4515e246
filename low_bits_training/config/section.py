"""The one mechanism behind our TOML sections (``[job]``, ``[profiling]``, ``[numerics]``, ``[quantize]``):
typed fields (``Literal[...]`` for choices, ``Annotated[int, AtLeast(0)]`` for bounds), checked when the
section is built, when the TOML sets its fields and when a command-line flag rebuilds it.

    @dataclass(kw_only=True, slots=True)
    class ProfilingConfig(Section):
        SECTION: ClassVar[str] = "profiling"
        flop_table_step: Annotated[int, AtLeast(0, "0: off")] = 0

A bad value is one ``ConfigError`` line naming the key, the value and what is allowed:
``profiling.flop_table_step = -1: expected an int >= 0 (0: off)``.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

from low_bits_training.config.tree import ConfigError, coerce, field_types


@dataclass(frozen=True)
class AtLeast:
    """A number field's lower bound (``Annotated[int, AtLeast(1)]``)."""

    bound: float
    note: str = ""
    """Said after the bound, in parentheses (``0: off``)."""

    def check(self, key: str, value: Any) -> None:
        """Raises: ConfigError when ``value`` is below the bound."""
        if value is not None and value < self.bound:
            what = "an int" if isinstance(value, int) else "a number"
            note = f" ({self.note})" if self.note else ""
            raise ConfigError(f"{key} = {value!r}: expected {what} >= {self.bound}{note}")


@dataclass(frozen=True)
class Matches:
    """A string field's shape (``Annotated[str, Matches(r"[a-z]+", "lower-case letters")]``)."""

    pattern: str
    description: str

    def check(self, key: str, value: Any) -> None:
        """Raises: ConfigError when ``value`` is not matched in full by the pattern."""
        if value is not None and not re.fullmatch(self.pattern, value):
            raise ConfigError(f"{key} = {value!r}: expected {self.description}")


def rules(tp: Any) -> list[Any]:
    """The checks (``AtLeast``, ``Matches``, anything with ``check(key, value)``) in an ``Annotated`` type."""
    if typing.get_origin(tp) is not typing.Annotated:
        return []
    return [m for m in typing.get_args(tp)[1:] if callable(getattr(m, "check", None))]


def check_fields(obj: Any, section: str) -> None:
    """Check every public field of dataclass ``obj`` against its annotation and its rules.

    Args:
        obj: a dataclass instance.
        section: its TOML section path, for messages (``profiling``).

    Raises:
        ConfigError: the first field whose value does not fit (one line: key, value, what is allowed).
    """
    types = field_types(type(obj))
    for f in dataclasses.fields(obj):
        if not f.init or f.name.startswith("_"):
            continue
        key, value, tp = f"{section}.{f.name}" if section else f.name, getattr(obj, f.name), types[f.name]
        coerce(value, tp, key)
        for rule in rules(tp):
            rule.check(key, value)


class Section:
    """Base of a section dataclass: ``check()`` runs at construction; ``SECTION`` names it in messages."""

    __slots__ = ()
    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raises: ConfigError (one line) for the first field that does not fit its type or rules."""
        check_fields(self, self.SECTION)
