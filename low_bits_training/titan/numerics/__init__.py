"""``[numerics]`` wired into the trainer, split by responsibility.

- ``config``: the ``[numerics]`` section (``NumericsConfig``).
- ``monitor``: sets what the quantized layers' in-graph probes record each step and reads them (statistics
  reduced over ranks into ``numerics.jsonl`` and the metrics loggers; the first NaN / Inf named).
- ``policy``: what a non-finite value does (warn / skip / stop) and the exit code of a stopped run.
"""

from .config import NumericsConfig, Policy
from .monitor import NumericsMonitor, reduce_raw
from .policy import NONFINITE_EXIT_CODE, NonFiniteError, TrainerExtras, exit_on_nonfinite, extras_for, warn

__all__ = [
    "NONFINITE_EXIT_CODE",
    "NonFiniteError",
    "NumericsConfig",
    "NumericsMonitor",
    "Policy",
    "TrainerExtras",
    "exit_on_nonfinite",
    "extras_for",
    "reduce_raw",
    "warn",
]
