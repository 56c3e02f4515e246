"""Running a step again: ``RedoStep`` (raised from a microbatch after a promotion on a non-finite value) and
``Replayable`` (the batches of that step, handed out again). The step hook uses both (``hook.run_step``)."""

from __future__ import annotations

from collections.abc import Iterator


class RedoStep(Exception):
    """Raised from a microbatch after a promotion: the trainer runs the step again under the new plan."""


class Replayable:
    """An iterator that remembers what it handed out since it was made; ``rewind`` hands the same again
    (the batches of a step that runs again), then goes on with the source."""

    def __init__(self, source: Iterator):
        self.source, self.seen, self.pos = source, [], 0

    def __iter__(self) -> Replayable:
        return self

    def __next__(self):
        if self.pos < len(self.seen):
            self.pos += 1
            return self.seen[self.pos - 1]
        item = next(self.source)
        self.seen.append(item)
        self.pos += 1
        return item

    def rewind(self) -> None:
        self.pos = 0
