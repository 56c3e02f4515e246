"""The run's side of the peak-memory plan: the peak the allocator measured on one step, logged beside the
launcher's plan (``titan/runtime/peak.py``; docs/memory.md, "Peak memory")."""

from __future__ import annotations

import json
import os

from torchtitan.tools.logging import logger

from low_bits_training.run.folder import PEAK_JSON, PEAK_METRIC, PEAK_PLAN_ENV, write_atomic
from low_bits_training.titan.platform.ranks import rank
from low_bits_training.titan.runtime.peak import gib


def planned_for_ranks() -> dict | None:
    """The plan the launcher made for this run (``PEAK_PLAN_ENV``), or None (no plan: started without the
    launcher, or a run it did not plan)."""
    text = os.environ.get(PEAK_PLAN_ENV)
    return json.loads(text) if text else None


def log_peak(trainer) -> dict | None:
    """After the step ``allocator_meter`` measured: this rank's measured peak (tensors alive at the step's
    start plus the most the step allocated above them), beside the launcher's plan; rank 0 logs both and
    writes ``peak_memory.json``, the metrics rank logs ``memory/peak_gib/*``. None on other steps."""
    meter = getattr(trainer, "_lbt_saved_meter", None)
    if meter is None or getattr(trainer, "_lbt_peak_done", False):
        return None
    trainer._lbt_peak_done = True
    plan = planned_for_ranks()
    measured = {"peak": meter.start + meter.peak, "at_start": meter.start, "step": trainer.step}
    metrics = {f"{PEAK_METRIC}/measured": measured["peak"] / 2**30}
    if plan is not None:
        metrics[f"{PEAK_METRIC}/planned"] = plan["later_steps"] / 2**30
    trainer.metrics_processor.logger.log(metrics, trainer.step)
    out = {"planned": plan, "measured": measured}
    if rank() != 0:
        return out
    said = f"measured {gib(measured['peak'])} GiB at step {trainer.step} on rank 0"
    if plan is not None:
        off = measured["peak"] / plan["later_steps"] - 1 if plan["later_steps"] else 0.0
        said += f", planned {gib(plan['later_steps'])} ({off:+.1%})"
    logger.info(f"Peak memory: {said}")
    os.makedirs(trainer.config.dump_folder, exist_ok=True)
    write_atomic(os.path.join(trainer.config.dump_folder, PEAK_JSON), json.dumps(out, indent=1) + "\n")
    return out
