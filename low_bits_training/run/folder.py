"""What a run folder (a training's ``dump_folder``) holds: one name for each file and for each metric the
tables read, and the one reader of its JSONL files (whole, or the last row of a run still training). Writers
live in ``titan/`` (metrics, resolved config), readers in ``report/`` and ``cli/``; both take the names from
here (``numerics.jsonl`` is named with its rows, in ``numerics/records.py``). Plain Python: reading a run
folder imports neither torch nor torchtitan.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
"""Every logged metric, one JSON line per logged step (``titan/runtime/metrics.py``)."""
CONFIG_TOML = "config.toml"
"""The resolved config: the base plus what differs from it; rerunnable as ``CONFIG_FILE``."""
CONFIG_JSON = "config.json"
"""The whole resolved config tree."""
COMMAND_TXT = "command.txt"
"""The command line of the run (credentials redacted)."""

LOSS = "loss_metrics/global_avg_loss"
"""The training loss in ``metrics.jsonl`` (torchtitan's metric name)."""
TPS = "throughput(tps)"
"""Tokens/s per process in ``metrics.jsonl``."""
MEMORY = ("memory/max_reserved(GiB)", "memory/max_active(GiB)")
"""Peak memory keys, preferred first (on CPU both are the process's peak resident set)."""
FIRST_LOG = "lbt/first_log_of_start"
"""True on the first training row a process writes (fresh or resumed), False on the others: that row's
throughput window holds the start-up (model build, compilation, checkpoint load), so throughput leaves it out
(``report.runs.RunData.tps``). Runs written before the key existed: the first training row is that row."""


def _row(line: str) -> dict[str, Any] | None:
    # One JSONL line, or None for a blank or torn one (a line being written when the run was killed).
    try:
        return json.loads(line) if line.strip() else None
    except json.JSONDecodeError:
        return None


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a JSONL file ([] when it does not exist); a torn last line (a killed writer) is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    return [row for line in path.read_text().splitlines() if (row := _row(line)) is not None]


def read_last_row(path: str | os.PathLike, tail: int = 8192) -> dict[str, Any] | None:
    """The last complete row of a JSONL file, reading only its last ``tail`` bytes (a run still training:
    the row being written, or cut by the tail, is skipped), or None."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - tail))
            lines = f.read().decode(errors="ignore").splitlines()
    except OSError:
        return None
    return next((row for line in reversed(lines) if (row := _row(line)) is not None), None)


def read_total_steps(folder: str | os.PathLike) -> int | None:
    """``training.steps`` of a run that has started (its ``config.json``), or None."""
    try:
        return int(json.loads((Path(folder) / CONFIG_JSON).read_text())["training"]["steps"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_metrics(folder: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a run folder's ``metrics.jsonl``, one per step in step order.

    Training and validation rows of a step are merged; a resumed run, or an autopilot rollback, appends the
    steps it redoes, and the later values win.
    """
    by_step: dict[int, dict[str, Any]] = {}
    for row in read_jsonl(Path(folder) / METRICS_FILE):
        by_step.setdefault(row["step"], {}).update(row)
    return [by_step[s] for s in sorted(by_step)]


STATE_BYTES_JSON = "state_bytes.json"
"""Bytes per parameter of each training state, computed from the config and measured after the first
optimizer step, summed over ranks (``titan/runtime/budget.py``)."""
STATE_BYTES_METRIC = "memory/state_bytes_per_param"
"""Metric prefix of the measured bytes per parameter: ``<prefix>/<state>``, ``<prefix>/total``, and the
computed ``<prefix>/plan_total``; logged once, at a process's first step."""

PEAK_JSON = "peak_memory.json"
"""Rank 0's planned peak memory (``titan/runtime/peak.py``, from the launcher) beside the peak the allocator
measured on the step ``allocator_meter`` measures (the second a process runs)."""
PEAK_PLAN_ENV = "LBT_PEAK_PLAN"
"""The launcher's planned peak (``PeakPlan.to_json``) handed to its ranks."""
PEAK_METRIC = "memory/peak_gib"
"""Metric prefix of the peak: ``<prefix>/measured`` and ``<prefix>/planned``, logged once."""

PLAN_TEXT = "precision_plan.txt"
"""The plan table of the run (one per phase with a schedule), as logged at the start
(``titan/targets/registry.py``)."""
PLAN_JSON = "precision_plan.json"
"""The plan of step 1, one object per entry (``plan.table.plan_to_json``)."""
GEMM_SIZES_JSON = "gemm_sizes.json"
"""FQN -> ``[in_features, out_features, copies]`` of every entry of the plan (``plan.resolve.LayerShape``):
each of its three GEMMs does 2 x tokens x in x out x copies FLOPs per step (the report's share of GEMM
FLOPs per format reads it)."""
SCHEDULE_JSON = "precision_schedule.json"
"""Every phase's plan with its first and last step; written only for a run with a schedule."""


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` (text, or bytes as they are) to ``path`` through a temporary file of this process and a
    rename: a reader, a killed writer or another process writing the same path never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if isinstance(data, bytes):
        tmp.write_bytes(data)
    else:
        tmp.write_text(data)
    os.replace(tmp, path)
