"""torchtitan's MetricsProcessor plus a JSONL file in the run folder: one line per logged step, every metric.

The JSONL file is what tests, sweeps and the report read: it needs no TensorBoard parser and no network. It is
written by the rank torchtitan picks for metrics (the last pipeline stage when PP is on), whatever
TensorBoard and W&B are set to.

Two changes to what torchtitan logs: the run's last step is always logged (upstream logs step 1 and every
``log_freq``-th, so a 6-step run with ``log_freq = 5`` ended at step 5), and on a device without a known peak
(the CPU) there is no MFU (upstream divides by an A100's peak there).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.metrics import BaseLogger, LoggerContainer, MetricsProcessor

from low_bits_training.run.folder import FIRST_LOG, METRICS_FILE, TPS, read_metrics
from low_bits_training.titan.platform import cpu
from low_bits_training.titan.platform.compat import MetricLoggerHook, metrics_rank
from low_bits_training.titan.platform.ranks import rank

__all__ = ["METRICS_FILE", "JsonlLogger", "LowBitsMetricsProcessor", "read_metrics"]


class JsonlLogger(BaseLogger):
    """Appends ``{"step": s, "time": t, <metric>: value, ...}`` lines to a file (flushed per line); training
    rows (those with throughput) also say whether they are this process's first (``runfolder.FIRST_LOG``)."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self._f = open(path, "a")
        self._first = True

    def log(self, metrics: dict[str, Any], step: int) -> None:
        row = {"step": step, "time": time.time()}
        row.update({k: _plain(v) for k, v in metrics.items()})
        if TPS in metrics:
            row[FIRST_LOG], self._first = self._first, False
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

    def __init__(self, config, *, config_dict: dict[str, Any] | None = None, **kwargs):
        super().__init__(config, config_dict=config_dict, **kwargs)
        # The run's last step (training.steps), always logged: the trainer passes its whole config as a dict.
        self.last_step = int((config_dict or {}).get("training", {}).get("steps", 0))
        self.last_logged: tuple[int, float, float] | None = None
        self.in_backward_norms: Callable[[], list[float]] | None = None
        """The trainer sets it when an optimizer updates in the backward (``in_backward``): the norms of the
        gradients its hooks used and freed, which torchtitan's clipping no longer sees."""
        if cpu.needs_cpu_adapters():
            # MFU divides by the device's bf16 peak; upstream has none for the CPU and takes an A100's
            # (tools/utils.py get_peak_flops). Its switch for "no MFU" is has_quantization (metrics.py log).
            self.has_quantization = True

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float, **kwargs):
        """Upstream's log; the step's loss and gradient norm (the same on every rank) are kept in
        ``last_logged`` for the autopilot's spike trigger (titan/runtime/autopilot/)."""
        if self.in_backward_norms is not None:  # the norm of every gradient of the step, as without it
            grad_norm = math.sqrt(float(grad_norm) ** 2 + sum(n * n for n in self.in_backward_norms()))
        self.last_logged = (step, float(global_avg_loss), float(grad_norm))
        return super().log(step, global_avg_loss, global_max_loss, grad_norm, **kwargs)

    def should_log(self, step: int) -> bool:
        """Upstream's steps (1 and every ``log_freq``-th) and the run's last step."""
        return super().should_log(step) or step == self.last_step

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
