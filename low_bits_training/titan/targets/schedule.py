"""Precision schedules in the trainer: the plan each step uses, evaluation's own plan, the compile budget.

The resolved ``plan.schedule.Schedule`` is turned into behaviour here:

- ``PrecisionSchedule.begin_step``: before every step the trainer asks for that step's phase; on a phase
  change every target whose kind can switch (``titan.targets.kind.TargetKind.switchable``: linear layers,
  MoE expert weights, attention products) gets its plan for the new phase (the same ``LinearPlan`` objects
  each time).
  A run resumed in a later phase switches at its first step. Layers quantized in some phase were built as
  QuantLinear (``titan.targets.linear``), so parameters and state_dict keys never change.
- ``EvalPrecision``: wraps torchtitan's validator; ``validate`` runs under ``[quantize.eval]``'s plan (when
  given) with the probes off, then the training plan comes back.
- ``round_as_eager``: compiled, inductor rounds low-precision intermediates where eager does (so activation
  checkpointing cannot change the forward's numbers).
- ``raise_recompile_limit``: the plan is a graph constant, so each distinct transformer-block plan compiles
  its own graph (once; switching back reuses it). The dynamo limit per code object is raised to what the
  schedule needs, so a long schedule never falls off the compiled path.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
from torchtitan.tools.logging import logger

from low_bits_training.formats import QuantSpec
from low_bits_training.nn import ROLE_NAMES, LinearPlan, ProbeMode, probe
from low_bits_training.nn.state import QuantState, live_targets
from low_bits_training.plan.schedule import PhasePlan, Schedule
from low_bits_training.titan.platform import compat

_BLOCK = re.compile(r"^(layers\.\d+)\.")


def phase_title(schedule: Schedule, phase: PhasePlan) -> str:
    """``quantize.phases[0]: steps 901-1000`` (``quantize.eval: evaluation``)."""
    if phase.first_step == 0:
        return f"{phase.label}: evaluation (torchtitan's validator)"
    return f"{phase.label}: steps {phase.first_step}-{schedule.last_step(phase)}"


class PrecisionSchedule:
    """Switches the quantized layers of ``model_parts`` between the schedule's plans."""

    def __init__(self, schedule: Schedule, layers: list[tuple[str, QuantState]]):
        self.schedule = schedule
        self.layers = layers
        self.current: PhasePlan | None = None
        self.overrides: dict[str, dict[str, QuantSpec | None]] = {}
        """Layer FQN -> role -> the spec that role keeps over every phase's (the autopilot's promotions)."""
        self._merged: dict[tuple, LinearPlan] = {}  # one object per distinct plan: compile guards on it

    @property
    def active(self) -> bool:
        """True when the run uses more than one plan."""
        return len(self.schedule.all()) > 1

    def plan_of(self, fqn: str, base: LinearPlan) -> LinearPlan:
        """``base`` (a phase's plan of layer ``fqn``) with the layer's overrides on top (the same object for
        the same result each time).

        Raises:
            ValueError: the overrides make a plan ``LinearPlan`` refuses.
        """
        ours = self.overrides.get(fqn)
        if not ours:
            return base
        key = (base, tuple(sorted(ours.items(), key=lambda kv: kv[0])))
        if key not in self._merged:
            specs = tuple(ours.get(r, s) for r, s in zip(ROLE_NAMES, base.specs, strict=True))
            self._merged[key] = LinearPlan(specs, base.backends)
        return self._merged[key]

    def override(self, fqn: str, role: str, spec: QuantSpec | None) -> LinearPlan:
        """Keep ``role`` of layer ``fqn`` in ``spec`` from now on, whatever the phase; returns its new plan.

        Raises:
            KeyError: ``fqn`` is not a switchable layer of this rank.
            ValueError: the plan with that spec is refused (the override is not kept).
        """
        layer = dict(self.layers)[fqn]
        before = dict(self.overrides.get(fqn, {}))
        self.overrides.setdefault(fqn, {})[role] = spec
        try:
            plan = self.plan_of(fqn, self._base(fqn))
            layer.check_plan(plan)  # what the target, as built, cannot run (an expert's padding)
            layer.plan = plan
        except ValueError:
            self.overrides[fqn] = before
            raise
        return layer.plan

    def _base(self, fqn: str) -> LinearPlan:
        phase = self.current or self.schedule.at(1)
        return phase.plans[fqn]

    def _apply(self, plans: dict[str, LinearPlan]) -> None:
        for fqn, layer in self.layers:
            layer.plan = self.plan_of(fqn, plans[fqn])

    def begin_step(self, step: int) -> None:
        """Give every layer the plan of ``step``'s phase (a no-op inside a phase)."""
        phase = self.schedule.at(step)
        if phase is self.current:
            return
        if self.current is not None or phase.first_step > 1:
            logger.info(f"Precision schedule: from step {step}, {phase_title(self.schedule, phase)}")
        self._apply(phase.plans)
        self.current = phase

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Evaluation's plan (``[quantize.eval]``, if given) and no probes, for the duration."""
        mode = probe.mode()
        probe.set_mode(ProbeMode())
        if self.schedule.eval is not None:
            self._apply(self.schedule.eval.plans)
        try:
            yield
        finally:
            if self.schedule.eval is not None and self.current is not None:
                self._apply(self.current.plans)
            probe.set_mode(mode)


class EvalPrecision:
    """torchtitan's validator, run under ``PrecisionSchedule.evaluating`` (everything else passes through)."""

    def __init__(self, validator, schedule: PrecisionSchedule):
        self._validator, self._schedule = validator, schedule

    def __getattr__(self, name: str):
        return getattr(self._validator, name)

    def validate(self, model_parts, step: int) -> None:
        with self._schedule.evaluating():
            return self._validator.validate(model_parts, step)


def block_plans(schedule: Schedule) -> set[tuple]:
    """The distinct transformer-block plans over every plan of the schedule (each compiles once)."""
    out = set()
    for phase in schedule.all():
        blocks: dict[str, list] = {}
        for fqn, plan in phase.plans.items():
            m = _BLOCK.match(fqn)
            if m:
                blocks.setdefault(m.group(1), []).append((fqn[m.end() :], plan))
        out |= {tuple(sorted(v, key=lambda x: x[0])) for v in blocks.values()}
    return out


def raise_recompile_limit(schedule: Schedule, stats: bool, promotions: int = 0) -> int:
    """Raise dynamo's per-code-object recompile limit to what this schedule needs (never lower it).

    Each distinct block plan compiles one graph per probe mode (statistics on / off) and one more for the
    validator's no-grad forward; two extra for anything else. Each of ``promotions`` (the autopilot's cap)
    may make one more block plan.

    Returns:
        The limit now in force.
    """
    need = (len(block_plans(schedule)) + promotions) * ((2 if stats else 1) + 1) + 2
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, need)
    return cfg.recompile_limit


def install(trainer, run) -> PrecisionSchedule:
    """Wire the schedule into a built trainer: the plan switcher, the validator's plan, the compile budget.

    Args:
        trainer: the built trainer.
        run: its resolved run (``titan.targets.registry.run_of``): the schedule and which entries can switch.

    Returns:
        The ``PrecisionSchedule`` whose ``begin_step`` the trainer calls before every step.
    """

    config = trainer.config
    mine = [(f, m) for f, m in live_targets(trainer.model_parts) if run.switchable(f)]
    sched = PrecisionSchedule(run.schedule, mine)
    if getattr(trainer, "validator", None) is not None and config.validator.enable:
        trainer.validator = EvalPrecision(trainer.validator, sched)
    if config.compile.enable:
        pilot = config.quantize.autopilot
        promotions = pilot.max_promotions if pilot.enable else 0
        stats = bool(config.numerics.stats_freq) or (pilot.enable and pilot.reads_stats)
        raise_recompile_limit(sched.schedule, stats, promotions)
        round_as_eager(sched.schedule)
    return sched


def round_as_eager(schedule: Schedule) -> bool:
    """Make inductor round every low-precision intermediate where eager does
    (``torch._inductor.config.emulate_precision_casts``, process-wide) when some target of the run is
    emulated in some phase; returns whether it did.

    Without it a bf16 value inside a fused kernel stays fp32, and where a graph materializes it depends on
    what the graph saves for the backward (inductor rounds a saved low-precision value,
    ``emulate_precision_casts_on_saved_tensors``): activation checkpointing, which recomputes instead of
    saving, then changed the forward's numbers (fp8_delayed, selective AC vs none, compiled through the
    launcher: 8.20734 vs 8.20692 at step 1; with it both give 8.207263). torchtitan's Float8 rowwise
    converter sets the same switch. On a GPU, Triton's approximate fp32 divide and its flush of subnormals
    would also break the casts' bit-faithfulness: ``compat.inductor_as_eager`` turns all three off.
    """
    quantized = schedule.quantized()
    emulated = any(
        not p.plans[f].is_high_precision and "emulate" in p.plans[f].backends
        for p in schedule.all()
        for f in quantized
    )
    if emulated:
        compat.inductor_as_eager()
    return emulated
