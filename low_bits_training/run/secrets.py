"""Credentials never reach a log or a saved file: any key or flag that names one has its value replaced.

Also the one answer to "has the user set W&B up?" (``wandb_credentials``): the launcher turns W&B on with it
and ``lbt-doctor`` reports it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from low_bits_training.config.argv import scan

SECRET_WORDS = ("token", "api_key", "apikey", "password", "secret", "credential")
REDACTED = "<redacted>"
WANDB_HOST = "api.wandb.ai"


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
    out = list(argv)
    for f in scan(argv):
        if not is_secret_key(f.name):
            continue
        if f.inline:
            out[f.start] = f"--{f.name}={REDACTED}"
        else:
            out[f.start + 1 : f.end] = [REDACTED] * (f.end - f.start - 1)
    return out


def wandb_credentials(env: Mapping[str, str]) -> str | None:
    """Where W&B credentials come from, or None when W&B is not set up. Never the key itself.

    Args:
        env: the environment to judge (``os.environ``).

    Returns:
        ``"WANDB_API_KEY"``, ``"WANDB_MODE=<mode>"``, ``"netrc"`` (an entry for api.wandb.ai in ``$NETRC`` or
        ``$HOME/.netrc``), or None.
    """
    if env.get("WANDB_API_KEY"):
        return "WANDB_API_KEY"
    if env.get("WANDB_MODE"):
        return f"WANDB_MODE={env['WANDB_MODE']}"
    netrc = Path(env.get("NETRC") or Path(env.get("HOME") or Path.home()) / ".netrc")
    if netrc.is_file() and WANDB_HOST in netrc.read_text(errors="ignore"):
        return "netrc"
    return None
