"""``[numerics]`` wired into the trainer, split by responsibility.

- ``config``: the ``[numerics]`` section (``NumericsConfig``).
- ``monitor``: sets what the quantized layers' in-graph probes record each step and reads them (statistics
  reduced over ranks into ``numerics.jsonl`` and the metrics loggers; the first NaN / Inf named).
- ``policy``: what a non-finite value does (warn / skip / stop); a stopped run's error and exit code are
  ``config/exits.py``'s.
"""

from .config import NumericsConfig, Policy
from .monitor import NumericsMonitor, reduce_raw
from .policy import NonFiniteError, TrainerExtras, extras_for, warn

__all__ = [
    "NonFiniteError",
    "NumericsConfig",
    "NumericsMonitor",
    "Policy",
    "TrainerExtras",
    "extras_for",
    "reduce_raw",
    "warn",
]
