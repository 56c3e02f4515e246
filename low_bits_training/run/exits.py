"""How a run ends: the one table of exit codes, for the launcher, every rank, the cli tools and
``run_llama_train.sh`` (README, "Exit codes"; ``tests/run/test_exits.py`` holds the script's and the
README's numbers to this enum).

A run that cannot go on raises one of the errors in ``ENDINGS``; the launcher turns it into one line
(``low-bits-training: <what>: <message>``) and its code. Anything else is a crash (its traceback, code 1).
Plain Python: the launcher's exit path imports neither torch nor torchtitan.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from low_bits_training.errors import ConfigError


class ExitCode(enum.IntEnum):
    """The exit code of the launcher (and of ``run_llama_train.sh``, ``submit.sh``'s jobs, the cli tools)."""

    OK = 0
    """Trained (or ``--help``)."""
    CRASH = 1
    """A crash (the failing rank's traceback); for ``lbt-sweep`` / ``lbt-scaling``: a run of the grid failed."""
    CONFIG = 2
    """Bad input: a key, value, flag, file or parallel layout, refused before any rank starts; for
    ``lbt-doctor``: a check FAILed (the job would be refused or break before it trains)."""
    NONFINITE = 3
    """``[numerics] nonfinite = "stop"`` stopped the run."""
    CHECKPOINT = 4
    """A checkpoint that cannot be resumed."""


SIGNAL_BASE = 128
"""A run stopped by signal N exits with ``SIGNAL_BASE + N`` (the shell's convention; Ctrl-C: 130)."""


class NonFiniteError(RuntimeError):
    """Raised on every rank by the "stop" policy (``titan/runtime/numerics``); the message is the one line for
    the user."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed (``titan/runtime/checkpoint.py``); the message says which and why
    in one line."""


@dataclass(frozen=True)
class Ending:
    """One way a run ends on purpose: the error, its exit code, the words its line starts with."""

    error: type[BaseException]
    code: ExitCode
    what: str


ENDINGS: tuple[Ending, ...] = (
    Ending(ConfigError, ExitCode.CONFIG, "config error"),
    Ending(NonFiniteError, ExitCode.NONFINITE, "stopped"),
    Ending(CheckpointError, ExitCode.CHECKPOINT, "checkpoint refused"),
)
"""Every error that ends a run on purpose, with its code; any other exception is ``ExitCode.CRASH``."""


def classify(error: BaseException) -> tuple[ExitCode, str] | None:
    """``(exit code, the one line)`` for an error of ``ENDINGS``; None for anything else (a crash)."""
    for ending in ENDINGS:
        if isinstance(error, ending.error):
            return ending.code, f"low-bits-training: {ending.what}: {error}"
    return None
