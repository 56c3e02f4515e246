"""Precision schedules: ``[[quantize.phases]]`` change the plan from a step on; ``[quantize.eval]`` gives
evaluation its own plan. Pure config: the resolved ``Schedule`` says which plan every step (and evaluation)
uses; ``titan/targets/schedule.py`` switches the layers.

    [quantize]
    recipe = "nvfp4"

    [[quantize.phases]]            # the last 10% of the steps: only the forward GEMM in high precision
    start = 0.9
    [[quantize.phases.rules]]
    roles = ["forward.*"]
    format = "high"

    [quantize.eval]                # the validator in bf16
    recipe = "bf16"

A phase (and the eval plan) is the ``[quantize]`` plan with the keys it gives replaced: ``recipe``,
``rules`` (the whole list), ``skip``; a key it leaves out is the base's. Phases do not build on each other.
``start``: an int counts the steps before the phase (start = 900: steps 901, 902, ...), a float in [0, 1) is
a fraction f of ``training.steps`` (the phase begins after round(f x steps) steps). Phases are listed in the
order they start; the ``[quantize]`` plan runs from step 1 until the first phase.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from low_bits_training.config.quantize import PlanChange, QuantizeConfig
from low_bits_training.errors import ConfigError
from low_bits_training.nn import LinearPlan
from low_bits_training.nn.hardware import Hardware
from low_bits_training.plan.backends import TORCHAO_BACKENDS
from low_bits_training.plan.resolve import LayerShape, resolve_plan


@dataclass(frozen=True)
class PhasePlan:
    """One resolved plan of a schedule: where it comes from, where it starts, the plan of every layer."""

    label: str
    """The TOML key it comes from: ``quantize``, ``quantize.phases[1]`` or ``quantize.eval``."""
    first_step: int
    """The first training step it runs (0 for the eval plan)."""
    plans: dict[str, LinearPlan]
    """FQN -> resolved plan (``plan.resolve.resolve_plan``)."""


@dataclass(frozen=True)
class Schedule:
    """The resolved schedule: training plans in step order, and evaluation's own plan (if any)."""

    phases: tuple[PhasePlan, ...]
    """Training plans by first step (the first starts at step 1)."""
    eval: PhasePlan | None
    """The validator's plan; None: it uses the training plan of the step it runs after."""
    steps: int
    """``training.steps`` the fractions were resolved against."""

    def at(self, step: int) -> PhasePlan:
        """The training plan of ``step`` (1-based)."""
        return [p for p in self.phases if p.first_step <= max(step, 1)][-1]

    def all(self) -> tuple[PhasePlan, ...]:
        """Every plan the run uses: the training phases, then the eval plan."""
        return (*self.phases, *([self.eval] if self.eval else []))

    def changing(self) -> list[str]:
        """FQNs whose plan is not the same in every plan of the schedule (model order)."""
        first = self.phases[0].plans
        return [f for f in first if any(p.plans[f] != first[f] for p in self.all())]

    def quantized(self) -> list[str]:
        """FQNs quantized in at least one plan (model order): these layers are QuantLinear from the start."""
        first = self.phases[0].plans
        return [f for f in first if any(not p.plans[f].is_high_precision for p in self.all())]

    def last_step(self, phase: PhasePlan) -> int:
        """The last training step of a phase."""
        later = [p.first_step for p in self.phases if p.first_step > phase.first_step]
        return min(later) - 1 if later else self.steps


def first_step(start: int | float, steps: int, where: str) -> int:
    """The first step of a phase that begins at ``start`` (see the module docstring).

    Raises:
        ConfigError: a start that is neither a step count in [0, steps) nor a fraction in [0, 1).
    """
    if isinstance(start, int) and not isinstance(start, bool) and 0 <= start < steps:
        return start + 1
    if isinstance(start, float) and math.isfinite(start) and 0 <= start < 1:
        return min(math.floor(start * steps + 0.5), steps - 1) + 1
    raise ConfigError(
        f"{where}.start = {start!r}: expected a step count (int, 0 <= start < training.steps = {steps}) or "
        "a fraction of training (float, 0 <= start < 1)"
    )


def is_empty(change: PlanChange) -> bool:
    """True when a phase / eval plan gives no key (it would be the base plan)."""
    return change.recipe is None and change.rules is None and change.skip is None


def changed_config(cfg: QuantizeConfig, change: PlanChange) -> QuantizeConfig:
    """The ``[quantize]`` section with the keys ``change`` gives replaced (no phases, no eval)."""
    given = {k: getattr(change, k) for k in ("recipe", "rules", "skip") if getattr(change, k) is not None}
    return dataclasses.replace(cfg, phases=[], eval=PlanChange(), **given)


def _starts(cfg: QuantizeConfig, steps: int) -> list[int]:
    """The first step of every phase, checked: each phase changes something and they are in start order."""
    out: list[int] = []
    for i, phase in enumerate(cfg.phases):
        where = f"quantize.phases[{i}]"
        if is_empty(phase):
            raise ConfigError(f"{where}: changes nothing; give recipe, rules or skip")
        step = first_step(phase.start, steps, where)
        if out and step <= out[-1]:
            prev = cfg.phases[i - 1].start
            how = "starts where" if step == out[-1] else "starts before"
            raise ConfigError(
                f"{where}.start = {phase.start!r} (step {step}) {how} quantize.phases[{i - 1}].start = "
                f"{prev!r} (step {out[-1]}): phases must not overlap and are listed in the order they start"
            )
        out.append(step)
    return out


def resolve_schedule(
    cfg: QuantizeConfig,
    layers: dict[str, LayerShape],
    steps: int,
    hw: Hardware | None = None,
    converted: dict[str, str] | None = None,
) -> Schedule:
    """Resolve ``[quantize]`` with its phases and eval plan against the model's layers.

    Args:
        cfg: the ``[quantize]`` section.
        layers: FQN -> shape of every layer the plan covers.
        steps: ``training.steps`` (fractions of training resolve against it).
        hw: the hardware (backend choice); default: a CPU.
        converted: layers a base's torchtitan converter already swapped (see ``resolve_plan``).

    Returns:
        The ``Schedule``; without phases it has one training plan (the plain ``resolve_plan`` result).

    Raises:
        ConfigError: anything ``resolve_plan`` refuses (named by the phase's key), a start out of range, an
            empty, overlapping or unsorted phase (a recipe name is checked when the section is built).
    """
    starts = _starts(cfg, steps)
    base = resolve_plan(cfg, layers, hw, converted)
    phases = [] if starts and starts[0] == 1 else [PhasePlan("quantize", 1, base)]
    for i, (phase, step) in enumerate(zip(cfg.phases, starts, strict=True)):
        where = f"quantize.phases[{i}]"
        phases.append(
            PhasePlan(where, step, resolve_plan(changed_config(cfg, phase), layers, hw, converted, where))
        )
    ev = None
    if not is_empty(cfg.eval):
        plans = resolve_plan(changed_config(cfg, cfg.eval), layers, hw, converted, "quantize.eval")
        ev = PhasePlan("quantize.eval", 0, plans)
    return Schedule(tuple(phases), ev, steps)


def check_switchable(schedule: Schedule, fixed: dict[str, str]) -> None:
    """Layers whose plan changes during the run must be targets that can switch plans (``TargetKind.switchable``).

    Args:
        schedule: the resolved schedule.
        fixed: FQN -> why that entry's module cannot switch (its kind's ``TargetKind.what``).

    Raises:
        ConfigError: a changing layer that torchao's module runs in some plan, or one named in ``fixed``.
    """
    for fqn in schedule.changing():
        where = next(p.label for p in schedule.all()[1:] if p.plans[fqn] != schedule.phases[0].plans[fqn])
        if fqn in fixed:
            raise ConfigError(
                f"{where}: changes the plan of {fqn} ({fixed[fqn]}); keep its plan the same in every phase"
            )
        ao = [p.label for p in schedule.all() if p.plans[fqn].backends[0] in TORCHAO_BACKENDS]
        if ao:
            raise ConfigError(
                f"{where}: changes the plan of {fqn}, which torchao's module runs in {ao[0]} (a module is fixed "
                "when the model is built); set quantize.backend = 'emulate' or keep its plan the same in every phase"
            )
