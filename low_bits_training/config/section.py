"""The one mechanism behind our TOML sections (``[job]``, ``[profiling]``, ``[numerics]``, ``[quantize]``):
typed fields (``Literal[...]`` for choices, ``Annotated[int, AtLeast(0)]`` for bounds), checked when the
section is built, when the TOML sets its fields and when a command-line flag rebuilds it. The checks of one
field live in its annotation and ``fields.coerce`` reads them, so a value built from TOML is refused under its
own key (``quantize.rules[0].scaling``) and a section built in Python is refused the same way.

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
from dataclasses import dataclass
from typing import Any, ClassVar

from low_bits_training.config.fields import coerce, field_types
from low_bits_training.config.tree import Checked
from low_bits_training.errors import ConfigError
from low_bits_training.formats import QuantSpec


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


@dataclass(frozen=True)
class Retired:
    """A value a choice field no longer takes, and where it went (said after the refusal):
    ``Annotated[Literal["emulate", "auto"], Retired("real", "use 'auto'")]``."""

    value: str
    note: str

    def refusal_note(self, value: Any) -> str:
        """`` (<note>)`` when ``value`` is the retired one, else ""."""
        return f" ({self.note})" if value == self.value else ""


def check_fields(obj: Any, section: str) -> None:
    """Check every public field of dataclass ``obj`` against its annotation, nested sections included.

    Each field is checked by ``fields.coerce`` (its type, ``Literal`` choices and ``Annotated`` rules); a field
    that holds a dataclass, or a list of them, is checked field by field under its own key
    (``quantize.rules[0].scaling``).

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
        key, value = f"{section}.{f.name}" if section else f.name, getattr(obj, f.name)
        coerce(value, types[f.name], key)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, item in items:
            if dataclasses.is_dataclass(item) and not isinstance(item, type):
                check_fields(item, key if i is None else f"{key}[{i}]")


class Section(Checked):
    """Base of a section dataclass: ``check()`` runs at construction and whenever ``tree.apply_dict`` sets its
    fields; ``SECTION`` names it in messages."""

    __slots__ = ()
    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raises: ConfigError (one line) for the first field that does not fit its type or rules."""
        check_fields(self, self.SECTION)


def checked_spec(where: str, *args: Any, **fields: Any) -> QuantSpec:
    """``QuantSpec(*args, **fields)`` of a section's fields; a refusal is one ``ConfigError`` line under the
    section's key (``quantize.saved[0].block_size = 0: ...`` where QuantSpec names the field).

    Raises:
        ConfigError: QuantSpec refused the fields.
    """
    try:
        return QuantSpec(*args, **fields)
    except (TypeError, ValueError) as e:
        msg = str(e).splitlines()[0]
        named = msg.replace("QuantSpec.", f"{where}.")  # the field's TOML key, when the message names one
        raise ConfigError(named if named != msg else f"{where}: {msg}") from None
