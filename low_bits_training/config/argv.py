"""The one reader of command-line flags in torchtitan's syntax: ``--a.b v``, ``--a.b=v``, ``--a.b v1 v2``
(a list), ``--a.b`` / ``--a.no-b`` (booleans).

Every place that needs a flag's value before tyro parses the command line (the config file, the base, the
recipe, which values to redact) asks here, so they all read argv the same way. Names compare with ``-`` and
``_`` alike, as tyro accepts both.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Flag:
    """One flag and the tokens that belong to it."""

    name: str
    """As typed, without the leading ``--`` (``training.steps``, ``checkpoint.no-enable``)."""
    values: tuple[str, ...]
    """Its values: the ``=`` part, or the tokens up to the next flag."""
    start: int
    """Index of the flag in argv; its tokens are ``argv[start:end]``."""
    end: int
    inline: bool
    """True for the ``--name=value`` form."""


def _norm(name: str) -> str:
    return name.removeprefix("--").replace("-", "_")


def _is_flag(token: str) -> bool:
    return token.startswith("--") and len(token) > 2


def scan(argv: list[str]) -> list[Flag]:
    """Every flag of ``argv`` in order (tokens before the first flag, and a bare ``--``, belong to none).

    Args:
        argv: command-line tokens.

    Returns:
        The flags with their values and token spans.
    """
    out: list[Flag] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if not _is_flag(token):
            i += 1
            continue
        if "=" in token:
            name, value = token[2:].split("=", 1)
            out.append(Flag(name, (value,), i, i + 1, True))
            i += 1
            continue
        j = i + 1
        while j < len(argv) and not _is_flag(argv[j]) and argv[j] != "--":
            j += 1
        out.append(Flag(token[2:], tuple(argv[i + 1 : j]), i, j, False))
        i = j
    return out


def flag_value(argv: list[str], name: str) -> str | None:
    """The first value of the last ``--name`` in ``argv`` (the last one wins, as in tyro), or None.

    Args:
        argv: command-line tokens.
        name: the flag without ``--`` (``job.base``).
    """
    hits = [f for f in scan(argv) if _norm(f.name) == _norm(name) and f.values]
    return hits[-1].values[0] if hits else None


def take_flag(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """Remove every ``--name`` (with its value) from ``argv``.

    Args:
        argv: command-line tokens.
        name: the flag without ``--`` (``config-file``).

    Returns:
        The last value given (None when absent) and argv without those tokens.
    """
    drop: set[int] = set()
    value = None
    for f in scan(argv):
        if _norm(f.name) == _norm(name):
            # A single-valued flag: only its first value is its own, later tokens go back to the rest.
            end = f.end if f.inline or not f.values else f.start + 2
            drop.update(range(f.start, end))
            value = f.values[0] if f.values else value
    return value, [a for i, a in enumerate(argv) if i not in drop]


def flag_names(argv: list[str]) -> list[str]:
    """The names of the flags in ``argv``, normalised (``_`` for ``-``), in order."""
    return [_norm(f.name) for f in scan(argv)]
