"""Set fields of a tree of dataclasses from a nested dict (parsed TOML), with types checked, and read a tree's
changes back as such a dict.

Generic on purpose: it knows dataclasses and typing, not torchtitan. A section path names a field the way
torchtitan's CLI does (``[training]`` -> ``config.training``, ``[parallelism] x = 2`` ->
``config.parallelism.x``). Every error is a ``ConfigError`` whose message is one line naming the key, the
value and what is allowed. Each value is checked against its field's annotation by ``config.fields.coerce``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from low_bits_training.config.fields import (
    coerce,
    dataclass_in,
    field_types,
    list_item_dataclass,
    named_choices,
    public_fields,
)
from low_bits_training.errors import ConfigError


class Checked:
    """A dataclass with checks across its fields: ``apply_dict`` calls ``check()`` again after it sets fields
    (``setattr`` does not run ``__post_init__``). ``config.section.Section`` is the one kind; it is declared
    here so that this module needs nothing above it."""

    __slots__ = ()

    def check(self) -> None:
        """Raises: ConfigError (one line) when the fields do not fit together."""


def apply_dict(obj: Any, data: dict[str, Any], where: str = "") -> None:
    """Set the fields of dataclass ``obj`` from ``data``, recursing into nested dataclasses.

    A field whose annotation is a union of named choices (torchtitan marks them with tyro subcommand names,
    e.g. ``activation_checkpoint``: ``selective | full | memory-budget | none``) takes the choice's name as a
    string, or a table with ``kind = "<name>"`` and that choice's fields. A list of dataclasses takes an
    array of tables (``[[optimizer.param_groups]]``) and replaces the list.

    Args:
        obj: a dataclass instance, changed in place.
        data: parsed TOML for this section.
        where: the section path so far, for messages (``"training"``, ``"parallelism"``).

    Raises:
        ConfigError: an unknown key, a missing required key, or a value of the wrong type.
    """
    hints = field_types(type(obj))
    allowed = public_fields(obj)
    for key, value in data.items():
        path = f"{where}.{key}" if where else key
        if key not in allowed:
            section = f"[{where}]" if where else "the top level"
            raise ConfigError(
                f"unknown key '{path}' in {section}; allowed keys: {', '.join(sorted(allowed))}"
            )
        setattr(obj, key, _value_for(getattr(obj, key), value, hints.get(key, Any), path))
    if data and isinstance(obj, Checked):
        obj.check()  # checks across fields: setattr does not run __post_init__


def _value_for(current: Any, value: Any, tp: Any, path: str) -> Any:
    choices = named_choices(tp)
    if choices and (isinstance(value, str) or (isinstance(value, dict) and "kind" in value)):
        return _choose(choices, value, path)
    if isinstance(value, dict) and dataclasses.is_dataclass(current):
        apply_dict(current, value, path)
        return current
    if isinstance(value, dict) and (cls := dataclass_in(tp)) is not None:
        return build_dataclass(cls, value, path)
    item = list_item_dataclass(tp)
    if item is not None and isinstance(value, list) and all(isinstance(v, dict) for v in value):
        return [build_dataclass(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    return coerce(value, tp, path)


def build_dataclass(cls: type, data: dict[str, Any], path: str) -> Any:
    """A new ``cls`` from ``data``: keys checked, values coerced, nested tables built.

    Raises:
        ConfigError: unknown or missing keys, wrong types, or a value the class itself refuses.
    """
    hints = field_types(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and not f.name.startswith("_")}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key '{path}.{unknown[0]}'; allowed keys: {', '.join(sorted(fields))}")
    kwargs = {k: _value_for(None, v, hints.get(k, Any), f"{path}.{k}") for k, v in data.items()}
    missing = [
        n
        for n, f in fields.items()
        if n not in kwargs and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{path}: missing required key '{missing[0]}' ({cls.__qualname__})")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise  # a Section's check already names the key
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path}: {str(e).splitlines()[0]}") from None


def _choose(choices: dict[str, type | None], value: Any, path: str) -> Any:
    name = value if isinstance(value, str) else value["kind"]
    if name not in choices:
        raise ConfigError(f"{path} = {name!r}: expected one of {', '.join(repr(c) for c in choices)}")
    cls = choices[name]
    fields = {} if isinstance(value, str) else {k: v for k, v in value.items() if k != "kind"}
    if cls is None:
        if fields:
            raise ConfigError(f"{path}: choice {name!r} takes no keys, got {', '.join(sorted(fields))}")
        return None
    return build_dataclass(cls, fields, path)


def diff(new: Any, old: Any, skip: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The leaves of dataclass tree ``new`` that differ from ``old``, as a nested dict that ``apply_dict``
    reads back (TOML-ready).

    Args:
        new, old: dataclass instances of the same class.
        skip: top-level field names to leave out (e.g. fields set in code, not from files).

    Returns:
        The nested dict. Values TOML cannot hold (callables, objects) are listed under the key
        ``"__untomlable__"`` of their section, so callers can say what a file cannot reproduce.
    """
    out: dict[str, Any] = {}
    hints = field_types(type(new))
    for name in public_fields(new):
        if name in skip:
            continue
        a, b = getattr(new, name), getattr(old, name, None)
        if dataclasses.is_dataclass(a) and type(a) is type(b):
            sub = diff(a, b)
            if sub:
                out[name] = sub
        elif a != b:
            plain = _choice_plain(a, hints.get(name)) if named_choices(hints.get(name)) else to_plain(a)
            if plain is None:
                out.setdefault("__untomlable__", []).append(name)
            else:
                out[name] = plain
    return out


def _choice_plain(v: Any, tp: Any) -> Any:
    # The inverse of _choose: a choice's name, or a table with ``kind``.
    for name, cls in named_choices(tp).items():
        if (cls is None and v is None) or (cls is not None and type(v) is cls):
            return name if v is None else {"kind": name, **to_plain(v)}
    return None


def to_plain(v: Any) -> Any:
    """``v`` as TOML-compatible data (bool, int, float, str, lists, dicts), or None if it has no such form."""
    if isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        items = [to_plain(x) for x in v]
        return None if any(x is None for x in items) else items
    if isinstance(v, dict):
        items = {str(k): to_plain(x) for k, x in v.items()}
        return None if any(x is None for x in items.values()) else items
    if dataclasses.is_dataclass(v):
        return {n: p for n in public_fields(v) if (p := to_plain(getattr(v, n))) is not None}
    return None
