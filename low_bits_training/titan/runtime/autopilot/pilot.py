"""``[quantize.autopilot]`` in the trainer: promote the role of a layer that fails, and say so.

This folder holds all of it: the decisions (``decisions``), the triggers and moves (``pilot``: non-finite
values and statistics; ``spikes``: loss / gradient-norm spikes, rolled back to host snapshots from
``snapshot``), the step run again (``replay``) and the step hook the trainer calls (``hook``).

Two ways in (``config/autopilot.py`` has the section, ``plan/ladder.py`` the ladder):

- ``on_nonfinite``: the numerics monitor named the first NaN / Inf of a microbatch (the same on every
  rank). When it is a GEMM's product of a quantized linear layer, expert weight or attention product, the
  quantized operands of that GEMM that can overflow (those without saturation; else all of them) go one
  rung up, and ``redo_if_promoted`` raises ``RedoStep``: the step hook runs the step again from its start
  with the same batches (no gradient was applied; every random stream derives from the step), so the run
  goes on as if the promoted plan had been there from this step.
- ``on_stats``: a statistics step's table (reduced over ranks) has a role over a threshold; it goes one
  rung up from the next step.

With ``demote_after`` a promoted role goes back down to the spec it left once it ran that many steps
(doubled for each earlier demotion of it) since its last move; a role that fails again is promoted again.

Promotions are overrides on the precision schedule (``titan.targets.schedule.PrecisionSchedule.override``):
they hold over every later phase. Each decision is logged (one line), counted in the metrics
(``autopilot/promotions``) and appended to ``<dump_folder>/autopilot.jsonl`` (rank 0). A resumed run reads
that file and replays the decisions of the steps before it, so it runs the plans the first run had.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

from torchtitan.tools.logging import logger

from low_bits_training.config.autopilot import AUTOPILOT_FILE, AutopilotConfig
from low_bits_training.nn import ROLE_NAMES
from low_bits_training.numerics import NonFinite
from low_bits_training.plan.ladder import parse_ladder, promote
from low_bits_training.run.folder import read_jsonl
from low_bits_training.titan.platform.ranks import is_rank0
from low_bits_training.titan.runtime.autopilot.decisions import (
    DEMOTE,
    DEMOTIONS,
    PROMOTIONS,
    ROLLBACKS,
    Decision,
    label,
)
from low_bits_training.titan.runtime.autopilot.replay import RedoStep
from low_bits_training.titan.runtime.autopilot.snapshot import Snapshots
from low_bits_training.titan.runtime.autopilot.spikes import SpikeTrigger
from low_bits_training.titan.targets.registry import TARGETS


class Autopilot(SpikeTrigger):
    """The decisions of one run over the switchable layers of ``schedule`` (a ``PrecisionSchedule``)."""

    def __init__(self, cfg: AutopilotConfig, schedule, dump_folder: str, checkpoint_every: int = 0):
        self.cfg, self.schedule = cfg, schedule
        self.ladder = parse_ladder(cfg.ladder)  # typed rungs, parsed once
        self.path = os.path.join(dump_folder, AUTOPILOT_FILE)
        self.layers = dict(schedule.layers)
        self.decisions: list[Decision] = []
        self.redos, self._step = 0, 0
        self._started = False
        self.stepped = False  # the step hook ran a step in this process (its first takes a snapshot)
        self._new = 0  # promotions not yet in the metrics
        self.rollbacks, self._new_rollbacks, self._new_demotions = 0, 0, 0
        self._rolled: dict[int, int] = {}  # step that spiked -> rollbacks it caused
        self._below: dict[tuple[str, str], list] = {}  # (layer, role) -> the specs it was promoted from
        self._since: dict[tuple[str, str], int] = {}  # ... -> the step of its last promotion or demotion
        self._demoted: dict[tuple[str, str], int] = {}  # ... -> how many times it went down again
        self.history: dict[int, tuple[float, float]] = {}  # logged step -> (loss, grad norm)
        self.last_table: list[dict] = []  # the newest statistics table (the spike's suspect)
        self.snapshots = None
        if cfg.spike_z:
            self.snapshots = Snapshots(cfg.snapshot_every, checkpoint_every, int(cfg.snapshot_gib * 2**30))
        watched = sum(not layer.plan.is_high_precision for layer in self.layers.values())
        logger.info(
            f"autopilot: ladder {' -> '.join(cfg.ladder)}; watches {watched} quantized targets "
            f"(of {len(self.layers)} that can switch plans: {', '.join(k.name for k in TARGETS if k.switchable)})"
        )

    def stats_step(self, step: int) -> bool:
        """True when the statistic triggers (or the spike trigger's suspect) read ``step`` (step 1 and every
        ``every``-th)."""
        return self.cfg.reads_stats and (step == 1 or step % self.cfg.every == 0)

    def begin_step(self, step: int) -> None:
        """Before each step and each run of it again (after the schedule's): on the first, replay the
        decisions of earlier steps; then demote the roles whose wait is over (``demote_after``)."""
        if step != self._step:
            self._step, self.redos = step, 0  # a run of the same step again keeps its count
        if not self._started:
            self._replay(step)
        self._demote(step)

    def _replay(self, step: int) -> None:
        self._started = True
        earlier = [Decision(**row) for row in read_jsonl(self.path) if row["step"] < step]
        for d in earlier:
            self._apply(d)
        if is_rank0():  # a resumed run redoes the steps after its checkpoint: their decisions go
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "w") as f:
                f.writelines(json.dumps(dataclasses.asdict(d)) + "\n" for d in earlier)
        if earlier:
            logger.info(f"autopilot: replayed {len(earlier)} decisions of steps before {step}")

    def _apply(self, d: Decision) -> None:
        """Take decision ``d`` again (a resumed run): the same moves in the same order give the same plans."""
        key = (d.layer, d.role)
        if d.trigger == DEMOTE and self._below.get(key):
            self._go_down(d.step, key)
        elif d.trigger != DEMOTE and d.layer in self.layers:
            before = self.layers[d.layer].plan.spec(d.role)
            got = self._next(d.layer, d.role)
            if got is not None:
                self.schedule.override(d.layer, d.role, got[0])
                self._went_up(d.step, key, before)
        self.decisions.append(d)

    def _went_up(self, step: int, key: tuple[str, str], before) -> None:
        self._below.setdefault(key, []).append(before)
        self._since[key] = step

    def _go_down(self, step: int, key: tuple[str, str]):
        """Put ``key`` back on the spec it was last promoted from; returns ``(now, then)`` specs."""
        layer, role = key
        now, then = self.layers[layer].plan.spec(role), self._below[key].pop()
        self.schedule.override(layer, role, then)
        self._demoted[key] = self._demoted.get(key, 0) + 1
        self._since[key] = step
        return now, then

    def _demote(self, step: int) -> None:
        """Try each promoted role one rung down once it ran ``demote_after x 2^(its demotions)`` steps since
        its last move."""
        if not self.cfg.demote_after:
            return
        for key, below in list(self._below.items()):
            wait = self.cfg.demote_after * 2 ** self._demoted.get(key, 0)
            if not below or step - self._since[key] < wait:
                continue
            clean = step - self._since[key]
            now, then = self._go_down(step, key)
            self._record(Decision(step, *key, DEMOTE, float(clean), label(now), label(then), "down"))
            self._new_demotions += 1

    def _next(self, layer: str, role: str):
        """``(spec, rung)`` one rung above ``role`` of ``layer`` now, or None (``plan.ladder.promote``),
        the spec as the target takes it (``QuantState.fit_spec``: an expert weight drops RHT / delayed)."""
        target = self.layers[layer]
        got = promote(target.plan.spec(role), role, self.ladder)
        return None if got is None else (target.fit_spec(got[0]), got[1])

    @property
    def promotions(self) -> int:
        return sum(bool(d.layer) and d.trigger != DEMOTE for d in self.decisions)

    @property
    def demotions(self) -> int:
        return sum(d.trigger == DEMOTE for d in self.decisions)

    def _promote(self, step: int, layer: str, role: str, trigger: str, value, seen: int = 0) -> bool:
        """Move ``role`` of ``layer`` one rung up (False: nothing above, refused, or the cap reached)."""
        if self.promotions >= self.cfg.max_promotions or layer not in self.layers:
            return False
        spec = self.layers[layer].plan.spec(role)
        got = self._next(layer, role)
        if got is None:
            return False
        try:
            self.schedule.override(layer, role, got[0])
        except ValueError as e:
            logger.warning(f"autopilot: {layer} {role} not promoted to {got[1]!r}: {e}")
            return False
        self._record(Decision(step, layer, role, trigger, value, label(spec), label(got[0]), got[1], seen))
        self._went_up(step, (layer, role), spec)
        self._new += 1
        return True

    def _record(self, d: Decision) -> None:
        self.decisions.append(d)
        logger.warning(d.message())
        if is_rank0():
            with open(self.path, "a") as f:
                f.write(json.dumps(dataclasses.asdict(d)) + "\n")

    def on_nonfinite(self, event: NonFinite) -> bool:
        """Promote the operands of the GEMM whose product was non-finite; True: run the step again."""
        if not self.cfg.nonfinite or self.redos >= self.cfg.max_redos or event.module not in self.layers:
            return False
        gemm, _, slot = event.role.partition(".")
        if slot != "output":  # a non-finite operand came from upstream: nothing here to promote
            return False
        plan = self.layers[event.module].plan
        quantized = [r for r in ROLE_NAMES if r.startswith(gemm + ".") and plan.spec(r) is not None]
        unsaturated = [r for r in quantized if not plan.spec(r).saturate]
        promoted = [
            r
            for r in (unsaturated or quantized)
            if self._promote(event.step, event.module, r, "nonfinite", event.role)
        ]
        if promoted:
            self.redos += 1
        return bool(promoted)

    def redo_if_promoted(self, event: NonFinite) -> None:
        """``on_nonfinite``, raising ``RedoStep`` when it promoted: the step hook runs the step again."""
        if self.on_nonfinite(event):
            raise RedoStep(event.message())

    def on_stats(self, step: int, table: list[dict]) -> None:
        """Promote each role of a statistics step's table whose figure passes its threshold."""
        if table:
            self.last_table = table
        if not self.stats_step(step):
            return
        for row in table:
            if row.get("whatif") or row["layer"] not in self.layers:
                continue
            for trigger, value in self._failing(row):
                if self._promote(step, row["layer"], row["role"], trigger, value):
                    break

    def _failing(self, row: dict) -> list[tuple[str, float]]:
        cfg, out = self.cfg, []
        clipped, under, sqnr = (float(row[k]) for k in ("clipping", "underflow", "sqnr_db"))
        if cfg.saturation and clipped > cfg.saturation:
            out.append(("saturation", clipped))
        if cfg.underflow and under > cfg.underflow:
            out.append(("underflow", under))
        if cfg.sqnr_db and not math.isnan(sqnr) and sqnr < cfg.sqnr_db:
            out.append(("sqnr_db", sqnr))
        return out

    def metrics(self) -> dict[str, float]:
        """``autopilot/promotions`` / ``autopilot/rollbacks`` when this step changed them (else nothing)."""
        out = {}
        if self._new:
            out[PROMOTIONS] = float(self.promotions)
        if self._new_rollbacks:
            out[ROLLBACKS] = float(self.rollbacks)
        if self._new_demotions:
            out[DEMOTIONS] = float(self.demotions)
        self._new = self._new_rollbacks = self._new_demotions = 0
        return out
