"""``[quantize.autopilot]`` in the trainer: promote the role of a layer that fails, and say so.

Two ways in (``config/autopilot.py`` has the section and the ladder):

- ``on_nonfinite``: the numerics monitor named the first NaN / Inf of a microbatch (the same on every
  rank). When it is a GEMM's product of a quantized linear layer, the quantized operands of that GEMM that
  can overflow (those without saturation; else all of them) go one rung up, and ``RedoStep`` is raised: the
  trainer runs the step again from its start with the same batches (no gradient was applied; every random
  stream derives from the step), so the run goes on as if the promoted plan had been there from this step.
- ``on_stats``: a statistics step's table (reduced over ranks) has a role over a threshold; it goes one
  rung up from the next step.

Promotions are overrides on the precision schedule (``titan.plan.schedule.PrecisionSchedule.override``):
they hold over every later phase. Each decision is logged (one line), counted in the metrics
(``autopilot/promotions``) and appended to ``<dump_folder>/autopilot.jsonl`` (rank 0). A resumed run reads
that file and replays the decisions of the steps before it, so it runs the plans the first run had.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from torchtitan.tools.logging import logger

from low_bits_training.config.autopilot import AUTOPILOT_FILE, AutopilotConfig, promote
from low_bits_training.config.runfolder import read_jsonl
from low_bits_training.nn import ROLE_NAMES
from low_bits_training.numerics import NonFinite
from low_bits_training.titan.platform.ranks import is_rank0

PROMOTIONS = "autopilot/promotions"
"""Metric: promotions so far in the run (logged at each step that promotes)."""


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


@dataclass(frozen=True)
class Decision:
    """One promotion: a line of ``autopilot.jsonl``."""

    step: int
    layer: str
    role: str
    trigger: str
    """``nonfinite`` (a NaN / Inf in ``value``'s GEMM product) or a statistic (``saturation``, ``underflow``,
    ``sqnr_db``)."""
    value: float | str
    """The statistic's figure, or the flag slot that was non-finite (``forward.output``)."""
    before: str
    after: str
    rung: str

    def message(self) -> str:
        figure = self.value if isinstance(self.value, str) else f"{self.value:.4g}"
        return (
            f"autopilot: step {self.step}: {self.layer} {self.role} {self.before} -> {self.after} "
            f"(rung {self.rung!r}; {self.trigger} {figure})"
        )


def _label(spec) -> str:
    return spec.short() if spec is not None else "high"


class Autopilot:
    """The decisions of one run over the switchable layers of ``schedule`` (a ``PrecisionSchedule``)."""

    def __init__(self, cfg: AutopilotConfig, schedule, dump_folder: str):
        self.cfg, self.schedule = cfg, schedule
        self.path = os.path.join(dump_folder, AUTOPILOT_FILE)
        self.layers = dict(schedule.layers)
        self.decisions: list[Decision] = []
        self.redos, self._step = 0, 0
        self._started = False
        self._new = 0  # promotions not yet in the metrics
        watched = sum(not layer.plan.is_high_precision for layer in self.layers.values())
        logger.info(
            f"autopilot: ladder {' -> '.join(cfg.ladder)}; watches {watched} quantized linear layers "
            f"(of {len(self.layers)} that can switch plans)"
        )

    def stats_step(self, step: int) -> bool:
        """True when the statistic triggers read ``step`` (step 1 and every ``every``-th)."""
        return self.cfg.stat_triggers and (step == 1 or step % self.cfg.every == 0)

    def begin_step(self, step: int) -> None:
        """Before each step and each run of it again (after the schedule's): on the first, replay the
        decisions of earlier steps."""
        if step != self._step:
            self._step, self.redos = step, 0  # a run of the same step again keeps its count
        if self._started:
            return
        self._started = True
        earlier = [Decision(**row) for row in read_jsonl(self.path) if row["step"] < step]
        for d in earlier:
            self._apply(d)
        if is_rank0():  # a resumed run redoes the steps after its checkpoint: their decisions go
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            with open(self.path, "w") as f:
                f.writelines(json.dumps(asdict(d)) + "\n" for d in earlier)
        if earlier:
            logger.info(f"autopilot: replayed {len(earlier)} decisions of steps before {step}")

    def _apply(self, d: Decision) -> None:
        got = self._next(d.layer, d.role) if d.layer in self.layers else None
        if got is not None:
            self.schedule.override(d.layer, d.role, got[0])
        self.decisions.append(d)

    def _next(self, layer: str, role: str):
        """``(spec, rung)`` one rung above ``role`` of ``layer`` now, or None (``config.autopilot.promote``)."""
        return promote(self.layers[layer].plan.spec(role), role, self.cfg.ladder)

    def _promote(self, step: int, layer: str, role: str, trigger: str, value) -> bool:
        """Move ``role`` of ``layer`` one rung up (False: nothing above, refused, or the cap reached)."""
        if len(self.decisions) >= self.cfg.max_promotions or layer not in self.layers:
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
        d = Decision(step, layer, role, trigger, value, _label(spec), _label(got[0]), got[1])
        self.decisions.append(d)
        self._new += 1
        logger.warning(d.message())
        if is_rank0():
            with open(self.path, "a") as f:
                f.write(json.dumps(asdict(d)) + "\n")
        return True

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

    def on_stats(self, step: int, table: list[dict]) -> None:
        """Promote each role of a statistics step's table whose figure passes its threshold."""
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
        sat, under, sqnr = (float(row[k]) for k in ("saturation", "underflow", "sqnr_db"))
        if cfg.saturation and sat > cfg.saturation:
            out.append(("saturation", sat))
        if cfg.underflow and under > cfg.underflow:
            out.append(("underflow", under))
        if cfg.sqnr_db and not math.isnan(sqnr) and sqnr < cfg.sqnr_db:
            out.append(("sqnr_db", sqnr))
        return out

    def metrics(self) -> dict[str, float]:
        """``autopilot/promotions`` when this step promoted (else nothing)."""
        if not self._new:
            return {}
        self._new = 0
        return {PROMOTIONS: float(len(self.decisions))}
