"""``[numerics]`` wired into the trainer, split by responsibility.

- the ``[numerics]`` section itself (``NumericsConfig``) is pure config: ``config/numerics.py``.
- ``monitor``: sets what the quantized layers' in-graph probes record each step and reads them (statistics
  reduced over ranks into ``numerics.jsonl`` and the metrics loggers; the first NaN / Inf named).
- ``policy``: what a non-finite value does (warn / skip / stop); a stopped run's error and exit code are
  ``run/exits.py``'s.
"""

from .monitor import NumericsMonitor, reduce_raw
from .policy import NonFiniteError, TrainerExtras, extras_for, warn

__all__ = [
    "NonFiniteError",
    "NumericsMonitor",
    "TrainerExtras",
    "extras_for",
    "reduce_raw",
    "warn",
]
