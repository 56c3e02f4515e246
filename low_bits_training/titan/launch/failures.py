"""What the console gets when a rank fails (``torchrun.run_torchrun``): a run that ended on purpose is its
rank's one line and exit code (``chosen_failure``); a crash is the crashed rank's exception, with its traceback
where ``LOG_RANK`` hides that rank's own output (``crash_report``), so the last line never points at output
that is not there.

Both come from torchrun's per-rank error file: a rank that ends on purpose writes its line there
(``worker.report``); a crash is written there by torchrun's ``record`` wrapper (around ``worker.main`` when the
rank is its own interpreter, around the forked rank by torchrun itself).
"""

from __future__ import annotations

import logging
from typing import Any

from low_bits_training.run.exits import ENDINGS, ExitCode


class HoldBack(logging.Filter):
    """Keeps torchrun's agent lines about a failed rank ("failed (exitcode: 3)", "closing signal") until we
    know whether the failure was one of ours (then its one line says it all) or a crash (then they are
    shown)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if record.levelno >= logging.WARNING and ("exitcode" in msg or "closing signal" in msg):
            self.held.append(record)
            return False
        return True


def chosen_failure(failures: dict) -> tuple[ExitCode, str] | None:
    """The exit code and line of the failure to report: rank 0's if it ended on purpose, else the lowest
    rank that did (None: no rank ended on purpose, a crash)."""
    ours = {e.code for e in ENDINGS}
    for _, failure in sorted(failures.items()):
        if failure.exitcode in ours:
            return ExitCode(failure.exitcode), failure.message
    return None


def crashed(failures: dict) -> tuple[int, Any]:
    """The crashed rank to report: the lowest one that ended with an exit code of its own, else the lowest
    (torchrun ends the others with SIGTERM once one fails: exit code -15)."""
    own = {rank: f for rank, f in failures.items() if f.exitcode > 0}
    return min((own or failures).items())


def shown(args, local_rank: int) -> bool:
    """Whether the console shows the output of ``local_rank`` (``--local-ranks-filter``, from LOG_RANK)."""
    named = args.local_ranks_filter
    return not named or str(local_rank) in {r.strip() for r in named.split(",")}


def crash_report(rank: int, failure: Any, on_console: bool) -> str:
    """What the console gets for a crashed rank: its traceback (torchrun's error file, which the rank's
    ``record`` wrapper wrote) when its own output was not shown, then one line naming the rank, its exit code
    and the exception, so the line never points at output that is not there.

    Args:
        rank: the global rank.
        failure: torchrun's ``ProcessFailure``: ``message`` is the error file's ``{"message": "Type: text",
            "extraInfo": {"py_callstack": ...}}``, or a string torchrun made up (a signal, no error file).
        on_console: ``shown(args, failure.local_rank)``.
    """
    data = failure.message if isinstance(failure.message, dict) else {"message": failure.message}
    error = str(data.get("message") or "")
    error = "" if error.startswith("To enable traceback") else error  # torchrun's text for "no error file"
    head = (
        f"low-bits-training: rank {rank} failed (exit code {failure.exitcode}){': ' + error if error else ''}"
    )
    if on_console:
        return f"{head}; see its output above"
    callstack = str((data.get("extraInfo") or {}).get("py_callstack") or "").rstrip()
    where = "its traceback above" if callstack else f"LOG_RANK={failure.local_rank} shows it"
    lines = [f"[rank{rank}]:{line}" for line in callstack.splitlines()]
    return "\n".join([*lines, f"{head}; its output is not on the console (LOG_RANK): {where}"])
