"""The autopilot's step hook (titan/runtime/autopilot/hook.py) on a fake trainer: an attempt dropped by a
promotion runs again on the same batches, and a rollback replays the batches the undone steps drew."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from low_bits_training.titan.runtime.autopilot import run_step
from low_bits_training.titan.runtime.autopilot.replay import RedoStep
from low_bits_training.titan.runtime.autopilot.snapshot import Snapshots
from low_bits_training.titan.runtime.autopilot.spikes import SpikeTrigger

BATCHES = 2
"""Batches one step draws (its microbatches)."""


class _Trainer(SimpleNamespace):
    """What the hook and ``snapshot.take`` / ``restore`` read of torchtitan's trainer (no model)."""

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state):
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def _trainer() -> _Trainer:
    return _Trainer(
        model_parts=[],
        optimizers=SimpleNamespace(optimizers=[]),
        lr_schedulers=SimpleNamespace(schedulers=[]),
        metrics_processor=SimpleNamespace(data_loading_times=[], last_logged=None),
        step=0,
        ntokens_seen=0,
        ran=[],  # (step, batches) of every attempt that was kept
    )


def _attempt(trainer: _Trainer, redo_at: set[int] = frozenset()):
    """torchtitan's step once: draws its batches; a step in ``redo_at`` is dropped once (a promotion)."""

    def attempt(batches) -> None:
        drawn = [next(batches) for _ in range(BATCHES)]
        if trainer.step in redo_at:
            redo_at.discard(trainer.step)
            raise RedoStep("promoted")
        trainer.ntokens_seen += len(drawn)
        trainer.ran.append((trainer.step, drawn))

    return attempt


class _Pilot(SpikeTrigger):
    """The autopilot's snapshots, with a spike scripted at ``spike_at`` (its first run only)."""

    def __init__(self, every: int = 0, spike_at: int = 0):
        self.stepped, self.spike_at = False, spike_at
        self.snapshots = Snapshots(every, 0, 2**30) if every else None
        self.firsts: list[bool] = []

    def before_step(self, trainer, step: int, first: bool) -> None:
        self.firsts.append(first)
        super().before_step(trainer, step, first)

    def after_step(self, trainer, step: int, logged):
        if step != self.spike_at:
            return None
        self.spike_at = 0
        return self.snapshots.target(step)


def _loop(pilot, trainer, steps: int, **attempt) -> list[str]:
    """torchtitan's train loop: ``train_step`` once per step; returns what ``dropped`` was called for."""
    data, dropped = iter(range(1000)), []
    while trainer.step < steps:
        trainer.step += 1
        run_step(pilot, trainer, data, _attempt(trainer, **attempt), lambda: dropped.append(trainer.step))
    trainer.left = next(data)  # the first batch no step drew
    return dropped


def test_without_an_autopilot_the_step_is_one_attempt_on_the_trainers_iterator():
    trainer, data, seen = _trainer(), iter(range(10)), []
    run_step(None, trainer, data, seen.append, lambda: pytest.fail("nothing to drop"))
    assert seen == [data]  # the iterator itself, not a replaying wrapper
    with pytest.raises(RedoStep):  # nothing catches a redo without an autopilot
        run_step(None, trainer, data, _attempt(trainer, {0}), lambda: None)


def test_a_dropped_attempt_runs_again_on_the_same_batches():
    trainer, pilot = _trainer(), _Pilot()
    dropped = _loop(pilot, trainer, 3, redo_at={2})
    assert dropped == [2]
    assert trainer.ran == [(1, [0, 1]), (2, [2, 3]), (3, [4, 5])]  # step 2's second run drew 2, 3 again
    assert trainer.left == 6 and pilot.firsts == [True, False, False]


def test_a_rollback_replays_the_recorded_batches_then_the_loop_goes_on():
    trainer, pilot = _trainer(), _Pilot(every=2, spike_at=4)
    _loop(pilot, trainer, 5)
    # snapshots of steps 0 and 2; the spike at 4 goes back to 2: steps 3 and 4 again, their own batches
    assert trainer.ran == [(1, [0, 1]), (2, [2, 3]), (3, [4, 5]), (4, [6, 7]), (3, [4, 5]), (4, [6, 7]),
                           (5, [8, 9])]  # fmt: skip
    assert trainer.left == 10 and trainer.step == 5
    assert trainer.ntokens_seen == 5 * BATCHES  # the undone steps' tokens went with the restore
    assert trainer.metrics_processor.data_loading_times == [0.0] * (2 * BATCHES)  # replayed: no loading
    assert pilot.firsts == [True, False, False, False, False, False, False]
