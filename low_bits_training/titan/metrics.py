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
from torchtitan.components.metrics import BaseLogger, LoggerContainer, MetricsProcessor

from low_bits_training.config.runfolder import METRICS_FILE, read_metrics
from low_bits_training.titan.compat import MetricLoggerHook, metrics_rank
from low_bits_training.titan.ranks import rank

__all__ = ["METRICS_FILE", "JsonlLogger", "LowBitsMetricsProcessor", "read_metrics"]


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


class LowBitsMetricsProcessor(MetricLoggerHook, MetricsProcessor):
    """MetricsProcessor that also writes ``<dump_folder>/metrics.jsonl``."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        enable_jsonl: bool = True
        """Write every logged metric to ``<dump_folder>/metrics.jsonl`` (the report and sweeps read it)."""

    def wrap_metric_logger(
        self, inner: BaseLogger, *, config, parallel_dims, dump_folder, pp_schedule, **kwargs
    ) -> BaseLogger:
        """Upstream's loggers plus the JSONL logger, on the rank torchtitan logs metrics from."""
        if not config.enable_jsonl or rank() != metrics_rank(parallel_dims, pp_schedule):
            return inner
        container = LoggerContainer()
        container.add_logger(inner)
        container.add_logger(JsonlLogger(os.path.join(dump_folder, METRICS_FILE)))
        return container
