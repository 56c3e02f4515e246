"""What a run folder (a training's ``dump_folder``) holds: one name for each file, and the one reader of its
JSONL files. Writers live in ``titan/`` (metrics, resolved config), readers in ``report/`` and ``cli/``; both
take the names from here (``numerics.jsonl`` is named with its rows, in ``numerics/records.py``). Plain Python: reading a run folder imports neither torch nor torchtitan.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
"""Every logged metric, one JSON line per logged step (``titan/metrics.py``)."""
CONFIG_TOML = "config.toml"
"""The resolved config: the base plus what differs from it; rerunnable as ``CONFIG_FILE``."""
CONFIG_JSON = "config.json"
"""The whole resolved config tree."""
COMMAND_TXT = "command.txt"
"""The command line of the run (credentials redacted)."""
RUN_FILES = (CONFIG_TOML, CONFIG_JSON, COMMAND_TXT)
"""What a run writes about itself once it really starts (``titan/configure.py: save_resolved``)."""


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a JSONL file ([] when it does not exist); a torn last line (a killed writer) is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # only a line being written when the run was killed can be incomplete
    return rows


def read_metrics(folder: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a run folder's ``metrics.jsonl``, one per step in step order.

    Training and validation rows of a step are merged; a resumed run appends the steps it redoes, and the
    later values win.
    """
    by_step: dict[int, dict[str, Any]] = {}
    for row in read_jsonl(Path(folder) / METRICS_FILE):
        by_step.setdefault(row["step"], {}).update(row)
    return [by_step[s] for s in sorted(by_step)]
