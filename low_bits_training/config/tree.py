"""Set fields of a tree of dataclasses from a nested dict (parsed TOML), with types checked.

Generic on purpose: it knows dataclasses and typing, not torchtitan. A section path names a field the way
torchtitan's CLI does (``[training]`` -> ``config.training``, ``[parallelism] x = 2`` ->
``config.parallelism.x``). Every error is a ``ConfigError`` whose message is one line naming the key, the
value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal, Union

from low_bits_training.errors import ConfigError


class Checked:
    """A dataclass with checks across its fields: ``apply_dict`` calls ``check()`` again after it sets fields
    (``setattr`` does not run ``__post_init__``). ``config.section.Section`` is the one kind; it is declared
    here so that this module needs nothing above it."""

    __slots__ = ()

    def check(self) -> None:
        """Raises: ConfigError (one line) when the fields do not fit together."""


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """``{field name: annotation}`` of a dataclass, ``Annotated`` metadata kept (named choices, bounds); read
    once per class (callers only read it)."""
    try:
        return typing.get_type_hints(cls, include_extras=True)  # keep Annotated: named choices
    except Exception:  # unresolvable forward references: fall back to the raw annotations
        return {f.name: f.type for f in dataclasses.fields(cls)}


def public_fields(obj: Any) -> list[str]:
    """Names of the settable fields of a dataclass instance (no private, no init=False)."""
    return [f.name for f in dataclasses.fields(obj) if f.init and not f.name.startswith("_")]


def _type_name(tp: Any) -> str:
    tp = _strip(tp)
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):  # TOML has no None: name the other members
        return " or ".join(_type_name(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is None and hasattr(tp, "__name__"):
        return tp.__name__
    return str(tp).replace("typing.", "")


def literal_choices(tp: Any) -> tuple[Any, ...]:
    """The ``Literal`` values an annotation allows (``Literal[...]``, ``Annotated`` or ``| None`` around it);
    () when it is not a choice."""
    tp = _strip(tp)
    members = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
    return tuple(
        a for m in map(_strip, members) if typing.get_origin(m) is Literal for a in typing.get_args(m)
    )


def _fits_choice_type(value: Any, tp: Any) -> bool:
    # A value of the choices' own type (a str for string choices) is wrong only by its value.
    return type(value) in {type(a) for a in literal_choices(tp)}


def _metadata(tp: Any, method: str) -> list[Any]:
    # The Annotated metadata of ``tp`` that offers ``method``.
    if typing.get_origin(tp) is not typing.Annotated:
        return []
    return [m for m in typing.get_args(tp)[1:] if callable(getattr(m, method, None))]


def rules(tp: Any) -> list[Any]:
    """The checks in an ``Annotated`` type: metadata with ``check(key, value)`` (``config.section.AtLeast``)."""
    return _metadata(tp, "check")


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp`` (its type, ``Literal`` choices and ``Annotated`` rules)
    and return it in the field's own type.

    Raises:
        ConfigError: the value does not fit; the message names ``key``, the value and what is allowed.
    """
    ok, out = _coerce(value, tp)
    if not ok:
        kind = "" if _fits_choice_type(value, tp) else f" ({type(value).__name__})"
        notes = "".join(m.refusal_note(value) for m in _metadata(tp, "refusal_note"))
        raise ConfigError(f"{key} = {value!r}{kind}: expected {_type_name(tp)}{notes}")
    for rule in rules(tp):
        rule.check(key, out)
    return out


def _strip(tp: Any) -> Any:
    # Annotated[X, ...] -> X
    return typing.get_args(tp)[0] if typing.get_origin(tp) is typing.Annotated else tp


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:  # noqa: C901 - one branch per kind of annotation
    tp = _strip(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is object or isinstance(tp, typing.TypeVar):
        return True, value
    if origin is Literal:
        return value in args and type(value) in {type(a) for a in args}, value
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:  # a field's "unset" (TOML itself has no None)
            return True, None
        for a in (a for a in args if a is not type(None)):
            ok, out = _coerce(value, a)
            if ok:
                return True, out
        return False, value
    if origin in (list, tuple, set, frozenset) or tp in (list, tuple):
        return _coerce_sequence(value, origin or tp, args)
    if origin is dict or tp is dict:
        return isinstance(value, dict), value
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if tp is str:
        return isinstance(value, str), value
    if isinstance(tp, type):
        return isinstance(value, tp), value
    return True, value  # annotations we cannot check (callables, protocols): accepted as given


def _coerce_sequence(value: Any, kind: type, args: tuple) -> tuple[bool, Any]:
    if not isinstance(value, list):
        return False, value
    if kind is tuple and len(args) == 2 and args[1] is Ellipsis:
        args = (args[0],)
    if kind is tuple and len(args) > 1:
        if len(args) != len(value):
            return False, value
        pairs = list(zip(value, args, strict=True))
    else:
        pairs = [(v, args[0] if args else Any) for v in value]
    out = []
    for v, a in pairs:
        ok, c = _coerce(v, a)
        if not ok:
            return False, value
        out.append(c)
    return True, kind(out)


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
    if isinstance(value, dict) and (cls := _dataclass_in(tp)) is not None:
        return build_dataclass(cls, value, path)
    item = _list_item_dataclass(tp)
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


def named_choices(tp: Any) -> dict[str, type | None]:
    """``{name: class or None}`` for a union whose members are ``Annotated[cls, <something with .name>]``."""
    if typing.get_origin(tp) not in (Union, types.UnionType):
        return {}
    out: dict[str, type | None] = {}
    for member in typing.get_args(tp):
        if typing.get_origin(member) is not typing.Annotated:
            continue
        cls, *meta = typing.get_args(member)
        name = next((m.name for m in meta if isinstance(getattr(m, "name", None), str)), None)
        if name is not None:
            out[name] = None if cls is type(None) else cls
    return out


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


def _list_item_dataclass(tp: Any) -> type | None:
    for t in map(_strip, (tp, *typing.get_args(_strip(tp)))):
        if typing.get_origin(t) is list:
            args = typing.get_args(t)
            if args and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
                return args[0]
    return None


def _dataclass_in(tp: Any) -> type | None:
    # The dataclass inside an annotation such as ``Foo.Config | None``.
    tp = _strip(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp
    for a in map(_strip, typing.get_args(tp)):
        if isinstance(a, type) and dataclasses.is_dataclass(a):
            return a
    return None


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
