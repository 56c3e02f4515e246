"""The error every layer raises for input a user can fix: ``ConfigError``, one line naming the key, the value
and what is allowed. It lives at the bottom of the package so that the recipe check (``nn.recipes``), the
sections (``config/``), the resolution (``plan/``) and the launcher raise the one class the exit-code table
(``run.exits``) turns into exit code 2."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value or key that cannot be used; the message is one line for the user."""


__all__ = ["ConfigError"]
