"""``[quantize.autopilot]`` in the trainer: promote the role of a layer that fails, and say so.

Two ways in (``config/autopilot.py`` has the section and the ladder):

- ``on_nonfinite``: the numerics monitor named the first NaN / Inf of a microbatch (the same on every
  rank). When it is a GEMM's product of a quantized linear layer, expert weight or attention product, the
  quantized operands of that GEMM that can overflow (those without saturation; else all of them) go one
  rung up, and ``RedoStep`` is raised: the
  trainer runs the step again from its start with the same batches (no gradient was applied; every random
  stream derives from the step), so the run goes on as if the promoted plan had been there from this step.
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

import json
import math
import os
import statistics
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from torchtitan.tools.logging import logger

from low_bits_training.config.autopilot import AUTOPILOT_FILE, AutopilotConfig
from low_bits_training.nn import ROLE_NAMES
from low_bits_training.numerics import NonFinite
from low_bits_training.plan.ladder import promote
from low_bits_training.run.folder import read_jsonl
from low_bits_training.titan.platform.ranks import is_rank0
from low_bits_training.titan.targets.registry import TARGETS

PROMOTIONS = "autopilot/promotions"
"""Metric: promotions so far in the run (logged at each step that promotes)."""
ROLLBACKS = "autopilot/rollbacks"
"""Metric: rollbacks to a host snapshot so far (logged at each step that rolls back)."""
DEMOTIONS = "autopilot/demotions"
"""Metric: demotions so far (``demote_after``; logged at each step that demotes)."""
DEMOTE = "clean"
"""The trigger (and rung) of a demotion: the role ran ``value`` steps since its last move."""


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
    """``nonfinite`` (a NaN / Inf in ``value``'s GEMM product), a statistic (``saturation``, ``underflow``,
    ``sqnr_db``), a spike (``loss_spike``, ``grad_norm_spike``) or ``clean`` (a demotion after ``value``
    steps)."""
    value: float | str
    """The statistic's figure, or the flag slot that was non-finite (``forward.output``)."""
    before: str
    after: str
    rung: str
    seen: int = 0
    """A spike's decision: the step that spiked (``step`` is the first step replayed under the new plan,
    right after the snapshot the run went back to); 0 for the other triggers."""

    def message(self) -> str:
        figure = self.value if isinstance(self.value, str) else f"{self.value:.4g}"
        back = f" (spike at step {self.seen}: rolled back to step {self.step - 1})" if self.seen else ""
        if not self.layer:
            return f"autopilot: step {self.step}: replay under the same plan{back}; {self.trigger} {figure}"
        return (
            f"autopilot: step {self.step}: {self.layer} {self.role} {self.before} -> {self.after} "
            f"(rung {self.rung!r}; {self.trigger} {figure}){back}"
        )


def robust_z(history: list[float], value: float) -> float:
    """How many robust standard deviations ``value`` lies above the median of ``history`` (median absolute
    deviation x 1.4826, floored at 1e-3 of the median's size so a flat history does not divide by zero)."""
    h = sorted(history)
    n = len(h)
    med = h[n // 2] if n % 2 else 0.5 * (h[n // 2 - 1] + h[n // 2])
    dev = sorted(abs(x - med) for x in h)
    mad = dev[n // 2] if n % 2 else 0.5 * (dev[n // 2 - 1] + dev[n // 2])
    scale = max(1.4826 * mad, 1e-3 * abs(med), 1e-12)
    return (value - med) / scale


def _label(spec) -> str:
    return spec.short() if spec is not None else "high"


class Autopilot:
    """The decisions of one run over the switchable layers of ``schedule`` (a ``PrecisionSchedule``)."""

    def __init__(self, cfg: AutopilotConfig, schedule, dump_folder: str, checkpoint_every: int = 0):
        self.cfg, self.schedule = cfg, schedule
        self.path = os.path.join(dump_folder, AUTOPILOT_FILE)
        self.layers = dict(schedule.layers)
        self.decisions: list[Decision] = []
        self.redos, self._step = 0, 0
        self._started = False
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
            from low_bits_training.titan.runtime.snapshot import Snapshots

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
                f.writelines(json.dumps(asdict(d)) + "\n" for d in earlier)
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
            self._record(Decision(step, *key, DEMOTE, float(clean), _label(now), _label(then), "down"))
            self._new_demotions += 1

    def _next(self, layer: str, role: str):
        """``(spec, rung)`` one rung above ``role`` of ``layer`` now, or None (``plan.ladder.promote``),
        the spec as the target takes it (``QuantState.fit_spec``: an expert weight drops RHT / delayed)."""
        target = self.layers[layer]
        got = promote(target.plan.spec(role), role, self.cfg.ladder)
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
        self._record(Decision(step, layer, role, trigger, value, _label(spec), _label(got[0]), got[1], seen))
        self._went_up(step, (layer, role), spec)
        self._new += 1
        return True

    def _record(self, d: Decision) -> None:
        self.decisions.append(d)
        logger.warning(d.message())
        if is_rank0():
            with open(self.path, "a") as f:
                f.write(json.dumps(asdict(d)) + "\n")

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

    # -- spikes: snapshots and rollback (titan/runtime/snapshot.py; the trainer replays) --

    def before_step(self, trainer, step: int, first: bool) -> None:
        """Take a host snapshot of the state ``step`` starts from when one is due (``Snapshots.due``)."""
        snaps = self.snapshots
        if snaps is None or not snaps.due(step, first):
            return
        from low_bits_training.titan.runtime.snapshot import take

        snap = take(trainer, step - 1)
        announce = not snaps.kept and not snaps.off
        snaps.add(snap)
        if snaps.off:
            logger.warning(f"autopilot: no snapshots kept ({snaps.off}): spikes are logged, not rolled back")
        elif announce:
            logger.info(
                f"autopilot: host snapshot of step {snap.step}: {snap.nbytes / 2**20:.1f} MiB on this rank, "
                f"{snap.seconds * 1e3:.0f} ms (every {snaps.every} steps and at checkpoints; 2 kept)"
            )

    def spike(self, step: int, loss: float, grad_norm: float) -> tuple[str, float] | None:
        """``(what, z)`` when ``step``'s logged loss or gradient norm spikes, else None: over a full window of
        earlier logged steps, ``robust_z`` above ``spike_z`` and the value above the median by its share
        (``spike_loss_rise``, ``spike_grad_rise``). The step joins the window either way."""
        cfg = self.cfg
        if not cfg.spike_z:
            return None
        past = [v for k, v in sorted(self.history.items()) if k < step][-cfg.spike_window :]
        self.history[step] = (loss, grad_norm)
        if len(past) < cfg.spike_window:
            return None
        rises = (cfg.spike_loss_rise, cfg.spike_grad_rise)
        for i, what in enumerate(("loss", "grad_norm")):
            window, value = [v[i] for v in past], (loss, grad_norm)[i]
            z = robust_z(window, value)
            if z > cfg.spike_z and value > statistics.median(window) * (1 + rises[i]):
                return what, z
        return None

    def after_step(self, trainer, step: int, logged: tuple[int, float, float] | None):
        """The snapshot to roll back to after ``step`` (None: go on). A spike with a snapshot to go back to
        and rollbacks left promotes the worst role (``on_spike = "promote"``) or nothing, and says so."""
        if logged is None or logged[0] != step:
            return None
        hit = self.spike(step, logged[1], logged[2])
        if hit is None:
            return None
        what, z = hit
        back = self.snapshots.target(step) if self.snapshots is not None else None
        why = (
            self.snapshots.off or "no snapshot yet" if back is None
            else f"max_rollbacks = {self.cfg.max_rollbacks} reached" if self.rollbacks >= self.cfg.max_rollbacks
            else ""
        )  # fmt: skip
        if why:
            logger.warning(f"autopilot: step {step}: {what} spike (z = {z:.1f}) not rolled back: {why}")
            return None
        suspect = self.suspect() if self.cfg.on_spike == "promote" else None
        if suspect is None and self._rolled.get(step):
            logger.warning(
                f"autopilot: step {step}: {what} spike (z = {z:.1f}) again after a replay under the same plan: "
                "kept (it is not a transient fault, and no role is left to promote)"
            )
            return None
        self.rollbacks += 1
        self._new_rollbacks += 1
        self._rolled[step] = self._rolled.get(step, 0) + 1
        self.history = {k: v for k, v in self.history.items() if k <= back.step}
        self.snapshots.back_to(back.step)
        trigger = f"{what}_spike"
        if suspect is None or not self._promote(back.step + 1, *suspect, trigger, z, seen=step):
            self._record(Decision(back.step + 1, "", "", trigger, z, "", "", "", step))
        return back

    def suspect(self) -> tuple[str, str] | None:
        """``(layer, role)`` the newest statistics table finds worst among the roles that can go up: the
        most clipped, else the most flushed to zero, else the lowest SQNR (None: no table, or nothing)."""
        if self.promotions >= self.cfg.max_promotions:
            return None
        rows = [
            r for r in self.last_table
            if not r.get("whatif") and r["layer"] in self.layers and self._next(r["layer"], r["role"])
        ]  # fmt: skip
        for key, sign in (("clipping", 1.0), ("underflow", 1.0), ("sqnr_db", -1.0)):
            scored = [(sign * float(r[key]), r) for r in rows if not math.isnan(float(r[key]))]
            scored = [(v, r) for v, r in scored if v > 0 or key == "sqnr_db"]
            if scored:
                best = max(scored, key=lambda vr: vr[0])[1]
                return best["layer"], best["role"]
        return None
