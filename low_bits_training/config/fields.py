"""Dataclass fields and their annotations: what type a field takes, which named choices, and whether a value
fits it.

Generic on purpose: it knows dataclasses and typing, not torchtitan. ``coerce`` checks one value against an
annotation (its type, ``Literal`` choices and ``Annotated`` rules such as ``config.section.AtLeast``) and
returns it in the field's own type (an int read from TOML for a float field becomes a float; a list for a
tuple field becomes a tuple); every refusal is a ``ConfigError`` whose message is one line naming the key,
the value and what is allowed. The rest reads annotations for ``config.tree``'s walk over a tree of dataclasses
and for the launcher's flags: field names, named choices (torchtitan's tyro subcommand unions), the dataclass
inside an annotation.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Literal, Union

from low_bits_training.errors import ConfigError


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


def list_item_dataclass(tp: Any) -> type | None:
    """The dataclass ``X`` of a ``list[X]`` annotation (``Annotated`` or ``| None`` around it), the item type
    of an array of tables; None when it is not such a list."""
    for t in map(_strip, (tp, *typing.get_args(_strip(tp)))):
        if typing.get_origin(t) is list:
            args = typing.get_args(t)
            if args and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
                return args[0]
    return None


def dataclass_in(tp: Any) -> type | None:
    """The dataclass inside an annotation such as ``Foo.Config | None`` (the first member that is one), or
    None."""
    tp = _strip(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp
    for a in map(_strip, typing.get_args(tp)):
        if isinstance(a, type) and dataclasses.is_dataclass(a):
            return a
    return None
