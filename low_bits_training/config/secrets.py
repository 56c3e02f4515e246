"""Credentials never reach a log or a saved file: any key or flag that names one has its value replaced."""

from __future__ import annotations

from typing import Any

SECRET_WORDS = ("token", "api_key", "apikey", "password", "secret", "credential")
REDACTED = "<redacted>"


def is_secret_key(key: str) -> bool:
    """True when a config key or flag names a credential (``hf_token``, ``--wandb.api_key``, ...)."""
    k = key.lower().replace("-", "_")
    return any(w in k for w in SECRET_WORDS)


def redact(d: Any) -> Any:
    """A copy of nested dicts/lists with the string values of secret-named keys replaced."""
    if isinstance(d, dict):
        return {
            k: REDACTED if is_secret_key(str(k)) and isinstance(v, str) else redact(v) for k, v in d.items()
        }
    if isinstance(d, list):
        return [redact(x) for x in d]
    return d


def redact_argv(argv: list[str]) -> list[str]:
    """argv with the values of secret-named flags replaced (``--x.token v`` and ``--x.token=v``)."""
    out, hide_next = [], False
    for a in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
        elif a.startswith("--") and "=" in a and is_secret_key(a.split("=", 1)[0]):
            out.append(a.split("=", 1)[0] + "=" + REDACTED)
        else:
            hide_next = a.startswith("--") and is_secret_key(a)
            out.append(a)
    return out
