"""The one step hook between the trainer and the autopilot: ``run_step`` runs one ``train_step`` call.

The trainer hands in what is its own, torchtitan's step run once on a batch source (``Attempt``) and what to
clear after an attempt that is dropped (``Dropped``); the hook owns the rest: the host snapshot before a
step, the attempt run again after a promotion on a non-finite value (``RedoStep``, same batches through
``Replayable``), the spike check after it, and the rollback to a snapshot with the steps after it run again
on the batches they drew the first time. Without an autopilot it is one attempt on the trainer's iterator.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from low_bits_training.titan.runtime.autopilot.pilot import Autopilot
from low_bits_training.titan.runtime.autopilot.replay import RedoStep, Replayable
from low_bits_training.titan.runtime.autopilot.snapshot import restore

Attempt = Callable[[Iterator], None]
"""torchtitan's step run once at ``trainer.step`` on a batch source (the trainer's seeds, schedule, extras and
per-step logs around it); it raises ``RedoStep`` from a microbatch when the autopilot promoted a role."""

Dropped = Callable[[], None]
"""What the trainer clears after an attempt that raised ``RedoStep`` (its saved bytes, its expert routing)."""


def run_step(
    pilot: Autopilot | None, trainer, data_iterator: Iterator, attempt: Attempt, dropped: Dropped
) -> None:
    """One call of the trainer's ``train_step`` at ``trainer.step``, the autopilot's moves around it.

    After a rollback the steps it undid run again here, up to the one torchtitan asked for, so its loop
    goes on from there.
    """
    if pilot is None:
        attempt(data_iterator)
        return
    end, first = trainer.step, not pilot.stepped
    pilot.stepped = True
    source = data_iterator
    while True:
        pilot.before_step(trainer, trainer.step, first)
        batches = _until_kept(source, attempt, dropped)
        first = False
        if pilot.snapshots is not None:
            pilot.snapshots.record(trainer.step, batches)
        logged = getattr(trainer.metrics_processor, "last_logged", None)
        back = pilot.after_step(trainer, trainer.step, logged)
        if back is not None:
            restore(trainer, back)  # trainer.step = back.step
        if trainer.step == end:
            return
        trainer.step += 1
        source = _replay(trainer, pilot.snapshots.batches[trainer.step])


def _until_kept(source: Iterator, attempt: Attempt, dropped: Dropped) -> list:
    """Run ``attempt`` until it is not dropped (each run after a ``RedoStep`` on the same batches); returns
    the batches the step drew."""
    batches = Replayable(source)
    while True:
        try:
            attempt(batches)
            return batches.seen
        except RedoStep:  # a role was promoted: the step again under the new plan, same batches
            batches.rewind()
            dropped()


def _replay(trainer, batches: list) -> Iterator:
    """The batches a step drew the first time, again (loading them took no time: torchtitan's metrics
    average the loading times of the step's batches)."""
    for batch in batches:
        trainer.metrics_processor.data_loading_times.append(0.0)
        yield batch
