"""Command-line flags in torchtitan's syntax refused in one line: tyro's framed error boxes rewritten as the
flag, the value and what is allowed (``tyro_message``, ``unknown_flag``, ``refused_choice``,
``unparsable_flag``), and the flags tyro cannot take as ``--a.b value`` (an array of tables, a choice) applied
as the TOML loader applies them (``table_flags``). Generic over any tree of dataclasses: the launcher's
``configure.parse_cli`` asks here; nothing here knows torchtitan."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import tomllib
import types
import typing
from collections.abc import Callable
from typing import Any

from low_bits_training.config.argv import flag_names, scan
from low_bits_training.config.fields import coerce, field_types, literal_choices, named_choices, public_fields
from low_bits_training.config.tree import apply_dict
from low_bits_training.errors import ConfigError

NO_PARSER = "Could not create CLI parser"
"""How tyro's message starts when it fails before it parses (it names a type, not the flag)."""


def _field_at(config: Any, name: str) -> tuple[Any, str, Any, str, str | None] | None:
    """Where a flag lands: ``(parent dataclass, field name, annotation, parent's section path, the choice
    field the path runs through or None)``; None when the path names no field of a dataclass (the parent
    may be None: a choice set to ``none``)."""
    *path, last = name.replace("-", "_").split(".")
    parent, through = config, None
    for i, part in enumerate(path):
        if dataclasses.is_dataclass(parent) and named_choices(field_types(type(parent)).get(part)):
            through = ".".join(path[: i + 1])
        parent = getattr(parent, part, None)
    if through is not None and parent is None:
        return None, last, field_types(type(config)).get(through.split(".")[0]), ".".join(path), through
    if not dataclasses.is_dataclass(parent) or isinstance(parent, type):
        return None
    return parent, last, field_types(type(parent)).get(last, Any), ".".join(path), through


def _is_table_list(tp: Any) -> bool:
    # list[SomeDataclass], possibly inside Annotated / Optional: TOML's array of tables
    if typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    members = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    for m in members:
        args = typing.get_args(m) if typing.get_origin(m) is list else ()
        if args and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
            return True
    return False


def table_flags(config: Any, args: list[str]) -> list[str]:
    """Apply the flags tyro cannot take in torchtitan's ``--a.b value`` form as the TOML loader applies the
    same key (``config.tree.apply_dict``), and return argv without them:

    - a named choice (``--activation_checkpoint selective``; tyro itself wants the subcommand token
      ``activation-checkpoint:selective``, which still works alone);
    - a field of the chosen one (``--activation_checkpoint.preserve_rng_state false``: tyro fails to build
      its parser for any flag after a subcommand token here);
    - a list of tables, given as a TOML inline array (``--quantize.rules '[]'``,
      ``--quantize.rules '[{layers = ["layers.*"], format = "e4m3"}]'``).

    Raises:
        ConfigError: a value the field refuses, or a field the choice does not have, naming the flag's key.
    """
    args = _subcommand_tokens(config, args)
    drop: set[int] = set()
    for flag in scan(args):
        found = _field_at(config, flag.name)
        if found is None or len(flag.values) != 1:
            continue
        parent, last, tp, where, through = found
        key = f"{where}.{last}" if where else last
        if through is not None:
            value = _choice_field_value(parent, last, tp, key, through, flag.values[0])
        elif named_choices(tp):
            value = flag.values[0]
        elif _is_table_list(tp):
            value = _toml_value(key, flag.values[0])
        else:
            continue
        apply_dict(parent, {last: value}, where)
        drop.update(range(flag.start, flag.end))
    return [a for i, a in enumerate(args) if i not in drop]


def _subcommand_tokens(config: Any, args: list[str]) -> list[str]:
    # tyro's own spelling of a choice, ``activation-checkpoint:selective``: applied like the flag form, so
    # the choice's fields may follow as flags (tyro cannot take them after the token here).
    out = []
    for token in args:
        name, sep, choice = token.partition(":")
        found = _field_at(config, name) if sep and not token.startswith("-") and "/" not in token else None
        if found is not None and found[4] is None and choice in named_choices(found[2]):
            apply_dict(found[0], {found[1]: choice}, found[3])
        else:
            out.append(token)
    return out


def _choice_field_value(parent: Any, last: str, tp: Any, key: str, through: str, text: str) -> Any:
    # A field of a chosen config (``activation_checkpoint.debug``): its value from the command-line text.
    if parent is None:  # tp: the top-level choice field's annotation (see _field_at)
        names = ", ".join(repr(n) for n in named_choices(tp))
        raise ConfigError(
            f"--{key}: {through} is 'none'; choose one of {names} first (--{through} <name>), then give "
            f"its fields as --{through}.<field> <value>"
        )
    allowed = public_fields(parent)
    if last not in allowed:
        raise ConfigError(
            f"unknown flag '--{key}'; allowed keys in [{through}] ({type(parent).__qualname__}): "
            f"{', '.join(sorted(allowed))}"
        )
    try:
        return coerce(text, tp, key)  # strings and string choices as given
    except ConfigError:
        literal = text.lower() if text in ("True", "False") else text  # tyro's spelling of booleans
        try:
            return tomllib.loads(f"v = {literal}")["v"]  # numbers, booleans, arrays; apply_dict checks
        except tomllib.TOMLDecodeError:
            return text  # apply_dict refuses it in the TOML loader's words


def _toml_value(key: str, text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(
            f'--{key} {text!r}: expected a TOML inline array of tables, e.g. \'[{{layers = ["layers.*"], '
            f'format = "e4m3"}}]\' (or write [[{key}]] tables in the TOML file)'
        ) from None


def unparsable_flag(parse: Callable[[list[str]], Any], args: list[str]) -> str | None:
    """The first flag ``parse`` (tyro over the config tree) refuses on its own, as one line naming it (None:
    each parses alone).

    For tyro's failures that name no flag: with this config tree, tyro's error report itself fails to build
    its parser (``Could not create CLI parser ...``, about ``quantize.rules``' type) for any refused value, so
    each flag is tried alone to find the one it refused.
    """
    for flag in scan(args):
        out = io.StringIO()
        try:
            with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
                parse(args[flag.start : flag.end])
        except SystemExit:
            given = " ".join(args[flag.start : flag.end])
            return (
                f"command line: {given}: refused (a value this flag does not take, or the wrong number of "
                "values; --help lists each flag's type, or set the key in the TOML file)"
            )
    return None


def unknown_flag(config: Any, args: list[str]) -> str | None:
    """The first flag that names no field of the config tree, as one line with the allowed keys (None: all
    name fields; ``--a.no-b`` names boolean ``a.b``). Paths into lists and choices are not followed."""
    for name in flag_names(args):
        obj, parts = config, name.split(".")
        for i, part in enumerate(parts):
            if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
                break
            fields = public_fields(obj)
            last = i == len(parts) - 1
            if part in fields:
                obj = getattr(obj, part)
            elif last and part.startswith("no_") and part[3:] in fields:
                break
            else:
                where = f"[{'.'.join(parts[:i])}]" if i else "the top level"
                return f"unknown flag '--{name}'; allowed keys in {where}: {', '.join(sorted(fields))}"
    return None


def refused_choice(config: Any, args: list[str]) -> str | None:
    """The first flag whose value is not one of its field's ``Literal`` choices, refused in the words the
    TOML loader uses (``quantize.backend = 'real': expected one of emulate, torchao, auto (...)``); tyro's own
    refusal would name the same, in other words. None: no such flag."""
    for flag in scan(args):
        *path, last = flag.name.replace("-", "_").split(".")
        parent = config
        for part in path:
            parent = getattr(parent, part, None)
        if len(flag.values) != 1 or not dataclasses.is_dataclass(parent) or isinstance(parent, type):
            continue
        tp = field_types(type(parent)).get(last)
        if tp is not None and literal_choices(tp) and flag.values[0] not in literal_choices(tp):
            try:
                coerce(flag.values[0], tp, flag.name.replace("-", "_"))
            except ConfigError as e:
                return str(e)
    return None


def tyro_message(box: str) -> str:
    """tyro's framed error as one line: the box's first paragraph (``Unrecognized options: --a.b, 4``).

    A value a section refuses (its ``ConfigError``, wrapped by tyro as ``Error parsing <section>: ...``)
    comes back as that section's own line.
    """
    lines = [ln.strip().strip("│").strip() for ln in box.splitlines()]
    seps = [i for i, ln in enumerate(lines) if ln and (set(ln) <= set("-─━") or ln[0] in "╭╰")]
    body = lines[seps[0] + 1 : seps[1]] if len(seps) > 1 else lines[(seps or [-1])[0] + 1 :]
    msg = " ".join(ln for ln in body if ln) or "tyro refused the command line"
    msg = msg.removeprefix("Error parsing ")
    name, sep, rest = msg.partition(": ")
    if sep and not name.startswith("-") and " " not in name and "=" in rest:
        return rest  # a section's own check: "profiling.x = -1: expected ..."
    return f"command line: {msg}"
