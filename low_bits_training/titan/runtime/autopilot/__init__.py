"""``[quantize.autopilot]``: everything the autopilot does in the trainer, in one folder (see ``pilot``).

The trainer and the numerics policy use ``Autopilot`` (the decisions), ``RedoStep`` and ``Replayable`` (a
step run again) and ``restore`` (a rollback to a snapshot); nothing else of it."""

from low_bits_training.titan.runtime.autopilot.pilot import Autopilot
from low_bits_training.titan.runtime.autopilot.replay import RedoStep, Replayable
from low_bits_training.titan.runtime.autopilot.snapshot import restore

__all__ = ["Autopilot", "RedoStep", "Replayable", "restore"]
