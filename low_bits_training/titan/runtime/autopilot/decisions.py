"""The autopilot's decisions: one record per promotion, demotion or rollback (a line of ``autopilot.jsonl``),
the metric names that count them, and the robust z-score of the spike trigger."""

from __future__ import annotations

from dataclasses import dataclass

PROMOTIONS = "autopilot/promotions"
"""Metric: promotions so far in the run (logged at each step that promotes)."""
ROLLBACKS = "autopilot/rollbacks"
"""Metric: rollbacks to a host snapshot so far (logged at each step that rolls back)."""
DEMOTIONS = "autopilot/demotions"
"""Metric: demotions so far (``demote_after``; logged at each step that demotes)."""
DEMOTE = "clean"
"""The trigger (and rung) of a demotion: the role ran ``value`` steps since its last move."""


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


def label(spec) -> str:
    return spec.short() if spec is not None else "high"
