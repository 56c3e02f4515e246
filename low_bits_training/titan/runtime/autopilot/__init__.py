"""``[quantize.autopilot]``: everything the autopilot does in the trainer, in one folder (see ``pilot``).

Its interface is small. The trainer calls one step hook, ``run_step(pilot, trainer, data_iterator, attempt,
dropped)`` (``hook``): it hands in torchtitan's step run once on a batch source and what to clear after a
dropped attempt; the hook owns the snapshots, the redo of a step and the rollback with its replay. The
numerics policy builds the ``Autopilot`` (the decisions) and feeds it: ``begin_step``, ``on_stats``,
``metrics``, and ``redo_if_promoted`` on a non-finite value (it raises what the hook catches).
Nothing else of it is used outside this folder."""

from low_bits_training.titan.runtime.autopilot.hook import run_step
from low_bits_training.titan.runtime.autopilot.pilot import Autopilot

__all__ = ["Autopilot", "run_step"]
