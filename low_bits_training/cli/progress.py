"""Progress of a sweep (``lbt-sweep``, ``lbt-scaling``): point i/N, elapsed, estimated time left, and the
running point's step and last loss, read from its run folder while it trains.

On a terminal it is a ``rich`` live display; in a log file (not a terminal) one line per point start and end.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from low_bits_training.run.folder import LOSS, METRICS_FILE, read_last_row, read_total_steps


def eta_seconds(elapsed: float, done: float, total: int) -> float:
    """Time left when ``done`` of ``total`` points (fractions count) took ``elapsed`` seconds (NaN: unknown)."""
    if done <= 0:
        return math.nan
    return elapsed * (total - done) / done


def clock(seconds: float) -> str:
    """``h:mm:ss`` (``-`` when unknown)."""
    if math.isnan(seconds):
        return "-"
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


@dataclass
class SweepProgress:
    """What a sweep has done so far; ``render()`` draws it, ``poll()`` reads the running point's folder."""

    total: int
    console: Console = field(default_factory=Console)
    started: float = field(default_factory=time.monotonic)
    done: int = 0
    failed: int = 0
    name: str = ""
    folder: Path | None = None
    step: int | None = None
    steps: int | None = None
    loss: float | None = None
    _live: Live | None = None

    def __enter__(self) -> SweepProgress:
        if self.console.is_terminal:
            self._live = Live(self.render(), console=self.console, refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self.render())
            self._live.__exit__(*exc)

    def start(self, name: str, folder: Path, args: str) -> None:
        """Point ``done + 1`` starts."""
        self.name, self.folder, self.step, self.steps, self.loss = name, folder, None, None, None
        if self._live is None:
            self.console.print(f"[{self.done + 1}/{self.total}] {name}: {args}", highlight=False)
        self._refresh()

    def poll(self) -> None:
        """Read the running point's last logged step and loss (and its step count once it has started)."""
        if self.folder is None:
            return
        row = read_last_row(self.folder / METRICS_FILE)
        if row is not None:
            self.step, self.loss = row.get("step"), row.get(LOSS, self.loss)
        self.steps = self.steps or read_total_steps(self.folder)
        self._refresh()

    def finish(self, returncode: int) -> None:
        """The running point ended with ``returncode``."""
        self.done += 1
        self.failed += returncode != 0
        if returncode != 0 or self._live is None:
            log = self.folder / "train.log" if self.folder else "-"
            status = "done" if returncode == 0 else f"exit code {returncode}; log: {log}"
            self.console.print(f"  {self.name}: {status} ({clock(self.elapsed())} elapsed)", highlight=False)
        self.folder = None
        self._refresh()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def fraction(self) -> float:
        """Points done, the running one counted by its steps."""
        part = self.step / self.steps if self.folder is not None and self.step and self.steps else 0.0
        return self.done + min(part, 1.0)

    def render(self) -> Table:
        """The display: one row for the sweep, one for the running point."""
        t = Table.grid(padding=(0, 2))
        eta = eta_seconds(self.elapsed(), self.fraction(), self.total)
        t.add_row(
            f"point {min(self.done + 1, self.total)}/{self.total}",
            f"elapsed {clock(self.elapsed())}",
            f"left ~{clock(eta)}",
            f"failed {self.failed}" if self.failed else "",
        )
        if self.folder is not None:
            step = f"step {self.step or 0}/{self.steps or '?'}"
            loss = f"loss {self.loss:.4f}" if isinstance(self.loss, (int, float)) else "loss -"
            t.add_row(self.name, step, loss, "")
        return t

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self.render())
