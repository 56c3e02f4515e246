"""Peak plans kept between processes, for a caller that starts many runs (the test suite sets it): with
``LBT_PEAK_CACHE=<folder>``, the launcher's plan of a run (``memory._planned``) is stored in that folder under a
digest of what decides it, and a later process checking a run that differs only in what the planner never
reads gets the same plan without planning again. Unset (the default): every check plans.

What decides a plan: the package's source and the versions of Python, torch, torchtitan and torchao; the
resolved config without the sections the planner never reads (``NOT_PLANNED``: where the run writes, logs,
checkpoints and reads its data, the learning-rate schedule, the step count, the seed; functions, such as
parameter initializers, by name); the ranks, the device and the limit. A changed source starts new entries; old ones stay until the folder is deleted.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from low_bits_training.run.folder import write_atomic
from low_bits_training.source import source_digest

PEAK_CACHE_ENV = "LBT_PEAK_CACHE"
"""The folder of kept plans (unset or empty: none kept)."""
NOT_PLANNED = (
    "hf_assets_path",
    "dump_folder",
    "profiler",
    "metrics",
    "dataloader",
    "checkpoint",
    "comm",
    "validator",
    "job",
    "profiling",
    "numerics",
    "lr_scheduler",
)
"""Top-level config keys ``titan/runtime/peak.py`` never reads (it feeds zeros for tokens and builds no
dataloader, checkpointer, logger, profiler, validator or monitor), left out of the key with ``training.steps``
and ``debug.seed``."""

T = TypeVar("T")
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
"""The memory address in a function's text (parameter initializers): another in every process."""


def plan_key(config: Any, *more: Any) -> str:
    """What decides ``config``'s plan, as text (``more``: the ranks, the device, the limit ...)."""
    d = config.to_dict()
    for k in NOT_PLANNED:
        d.pop(k, None)
    d.get("training", {}).pop("steps", None)
    d.get("debug", {}).pop("seed", None)
    return _ADDRESS.sub("", json.dumps([d, *more], sort_keys=True, default=str))


_digest = functools.cache(source_digest)
"""``source.source_digest``, read once per process (the source under a running process does not change)."""


def kept(key: str, make: Callable[[], T]) -> T:
    """``make()``, or with ``LBT_PEAK_CACHE`` set what an earlier ``make()`` of the same ``key`` and source gave
    (stored there after it ran; an exception is raised as it comes and nothing is stored)."""
    folder = os.environ.get(PEAK_CACHE_ENV)
    if not folder:
        return make()
    path = Path(folder) / (hashlib.sha256((_digest() + key).encode()).hexdigest()[:32] + ".pkl")
    if path.exists():
        return pickle.loads(path.read_bytes())
    value = make()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, pickle.dumps(value))
    return value
