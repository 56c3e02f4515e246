"""torchtitan's MetricsProcessor plus a JSONL file in the run folder: one line per logged step, every metric.

The JSONL file is what tests, sweeps and the report read: it needs no TensorBoard parser and no network. It is
written by the rank torchtitan picks for metrics (the last pipeline stage when PP is on), whatever
TensorBoard and W&B are set to.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.metrics import BaseLogger, LoggerContainer, MetricsProcessor, _get_metrics_rank

METRICS_FILE = "metrics.jsonl"


class JsonlLogger(BaseLogger):
    """Appends ``{"step": s, "time": t, <metric>: value, ...}`` lines to a file (flushed per line)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._f = open(path, "a")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": step, "time": time.time()}
        row.update({k: _plain(v) for k, v in metrics.items()})
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _plain(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf; "nan" / "inf" keep the fact
    return v


class LowBitsMetricsProcessor(MetricsProcessor):
    """MetricsProcessor that also writes ``<dump_folder>/metrics.jsonl``."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        enable_jsonl: bool = True
        """Write every logged metric to ``<dump_folder>/metrics.jsonl`` (the report and sweeps read it)."""

    def _build_metric_logger(
        self, *, config, parallel_dims, dump_folder, pp_schedule, **kwargs
    ) -> BaseLogger:
        inner = MetricsProcessor._build_metric_logger(
            self,
            config=config,
            parallel_dims=parallel_dims,
            dump_folder=dump_folder,
            pp_schedule=pp_schedule,
            **kwargs,
        )
        if not config.enable_jsonl:
            return inner
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if rank != _get_metrics_rank(parallel_dims=parallel_dims, pp_schedule=pp_schedule):
            return inner
        container = LoggerContainer()
        container.add_logger(inner)
        container.add_logger(JsonlLogger(os.path.join(dump_folder, METRICS_FILE)))
        return container


def read_metrics(folder: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows of a run folder's ``metrics.jsonl`` (training and validation rows of a step merged;
    a resumed run appends, and later values win)."""
    by_step: dict[int, dict[str, Any]] = {}
    with open(os.path.join(folder, METRICS_FILE)) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                by_step.setdefault(row["step"], {}).update(row)
    return [by_step[s] for s in sorted(by_step)]
