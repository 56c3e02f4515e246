"""The autopilot's spike trigger: a loss or gradient-norm spike rolls the state back to a host snapshot
(``snapshot``) and the trainer replays the steps after it, with the worst role promoted
(``on_spike = "promote"``) or under the same plan."""

from __future__ import annotations

import math
import statistics

from torchtitan.tools.logging import logger

from low_bits_training.titan.runtime.autopilot.decisions import Decision, robust_z
from low_bits_training.titan.runtime.autopilot.snapshot import take


class SpikeTrigger:
    """The spike half of ``Autopilot`` (a mixin: it reads the pilot's ``cfg``, ``snapshots``, ``history``,
    ``last_table`` and promotes through its ``_promote``)."""

    def before_step(self, trainer, step: int, first: bool) -> None:
        """Take a host snapshot of the state ``step`` starts from when one is due (``Snapshots.due``)."""
        snaps = self.snapshots
        if snaps is None or not snaps.due(step, first):
            return
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
