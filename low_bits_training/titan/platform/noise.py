"""Upstream log lines a user cannot act on, dropped by their words, in this one place.

Each entry names the logger that writes the line, the words that identify it and why no user can act on it.
``install()`` puts one filter on each of those loggers (at the source: a handler torchtitan or torch adds
later still never sees the line). Importing titan installs it (``stand.py``), before any torchtitan or torchao
import, in the launcher and every rank; the cli tools also call it first, some of which import titan for
nothing else. Every other record passes, the same logger's other lines included (``tests/test_noise.py``).
Plain ``logging``: installing it imports neither torch nor torchtitan.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Noise:
    """One upstream line to drop."""

    logger: str
    """The logger that writes it (``""``: the root logger, torchtitan's ``logger``)."""
    words: str
    """A regular expression searched in the record's message."""
    why: str
    """Where it comes from and why nobody can act on it."""


NOISE: tuple[Noise, ...] = (
    Noise(
        "torch.utils._pytree",
        r"is an Enum subclass and is now natively supported by torch\.compile as an opaque value type\. "
        r"Calling register_constant\(\) on Enum subclasses is deprecated",
        "torchao 0.18.0 registers its config enums with torch's pytree when imported (torchao/utils.py); "
        "torch 2.14.1 deprecates that (torch/utils/_pytree.py). Once per enum, at every import of torchao.",
    ),
    Noise(
        "",
        r"^initial_load_model_only=True has no effect without an initial_load_path\.$",
        "torchtitan 0.3.0's CheckpointManager.Config defaults initial_load_model_only to True and warns "
        "about that default in every check of a config without initial_load_path "
        "(torchtitan/components/checkpointer/base.py): once per config checked, several times in lbt-doctor.",
    ),
)
"""What ``install()`` drops; nothing else."""


class UpstreamNoise(logging.Filter):
    """Drops the records of one logger whose message matches an entry of ``NOISE`` for that logger."""

    def __init__(self, logger: str) -> None:
        super().__init__()
        self.patterns = [re.compile(n.words) for n in NOISE if n.logger == logger]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.search(message) for p in self.patterns)


def install() -> None:
    """Filter ``NOISE`` at its loggers; calling it again adds nothing."""
    for name in dict.fromkeys(n.logger for n in NOISE):
        logger = logging.getLogger(name or None)
        if not any(isinstance(f, UpstreamNoise) for f in logger.filters):
            logger.addFilter(UpstreamNoise(name))
