"""The registry of plan targets and the run resolved once: what every tool reads.

``TARGETS`` lists the kinds of target (``titan.targets.kind.TargetKind``): the FSDP2 collectives first (their
check may switch torchao's fp8 all-gather on before the linears are converted), then linear layers, MoE
expert weights, attention products and what autograd saves for the backward. Nothing else enumerates the kinds.

``resolve_run(config, hw)`` is the one resolution: from the config and the hardware it returns the
``ResolvedRun`` (every entry's shape and kind, the schedule of plans, the what-if tables, the wire formats)
without touching the config. ``apply_run`` is the one visible step that changes the config tree for it.
``run_of(config)`` gives the run a process already resolved for that config object: the launcher's check,
every rank, doctor, the plan table and the saved ``precision_plan.*`` files all read it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from low_bits_training.config.comm import wire_spec
from low_bits_training.formats import QuantSpec
from low_bits_training.nn import LinearPlan
from low_bits_training.nn.hardware import Hardware, detect_hardware
from low_bits_training.nn.state import QuantState, live_targets
from low_bits_training.plan.resolve import LayerShape
from low_bits_training.plan.schedule import Schedule, check_switchable, resolve_schedule
from low_bits_training.plan.table import fallbacks, format_fallbacks, format_plan, plan_to_json
from low_bits_training.plan.whatif import resolve_whatif
from low_bits_training.run.folder import GEMM_SIZES_JSON, PLAN_JSON, PLAN_TEXT, SCHEDULE_JSON, write_atomic
from low_bits_training.titan.targets import attention, experts, linear, saved, wire
from low_bits_training.titan.targets.kind import TargetKind
from low_bits_training.titan.targets.schedule import phase_title

TARGETS: tuple[TargetKind, ...] = (wire.KIND, linear.KIND, experts.KIND, attention.KIND, saved.KIND)
"""Every kind of plan target, in the order ``apply_run`` converts them."""

_RUNS: dict[int, tuple[object, ResolvedRun]] = {}
"""id(config) -> (config, its run) for the configs ``apply_run`` rewrote in this process."""
RESOLUTIONS = [0]
"""How many times this process resolved a run (``resolve_run``): tests hold it to one per run."""


@dataclass(frozen=True)
class ResolvedRun:
    """Everything the plan decides for one run on one hardware."""

    hardware: Hardware
    shapes: dict[str, LayerShape]
    """FQN -> shape of every GEMM entry, in model order, kind by kind."""
    kinds: dict[str, TargetKind]
    """FQN -> the kind of target it is."""
    converted: dict[str, str]
    """FQN -> label of entries a base's own torchtitan converter swapped (not covered by the plan)."""
    schedule: Schedule
    """The plans of every phase (and evaluation): ``schedule.at(1)`` is what the model is built with."""
    whatif: dict
    """FQN -> ``WhatIf`` of the linear layers recording what-if statistics."""
    wire: tuple[QuantSpec | None, QuantSpec | None]
    """``[quantize.comm]``'s all-gather and reduce-scatter formats (None: FSDP2's own dtype)."""
    saved: dict = field(default_factory=dict)
    """Module FQN -> ``config.saved.SavedFormat`` of ``[[quantize.saved]]`` (what its forward saves)."""

    @property
    def plans(self) -> dict[str, LinearPlan]:
        """The plan of step 1 (what the converter builds)."""
        return self.schedule.at(1).plans

    def keep(self) -> set[str]:
        """Entries built quantized even where step 1 keeps them high (a later phase, what-if statistics)."""
        return {*self.schedule.quantized(), *self.whatif}

    def labels(self, plans: dict[str, LinearPlan] | None = None) -> dict[str, str]:
        """FQN -> the module each entry builds under ``plans`` (default: step 1's), plus converted ones."""
        plans = plans if plans is not None else self.plans
        out = {fqn: self.kinds[fqn].label(plans, fqn) for fqn in plans}
        return {**out, **self.converted}

    def switchable(self, fqn: str) -> bool:
        """Whether ``fqn``'s module can take another plan mid-run (its kind says)."""
        return self.kinds[fqn].switchable


def entries(config) -> tuple[dict[str, LayerShape], dict[str, TargetKind]]:
    """Every GEMM entry of ``config``'s model (before or after ``apply_run``): shape and kind by FQN."""
    shapes, kinds = {}, {}
    for kind in TARGETS:
        for fqn, shape in kind.entries(config).items():
            shapes[fqn], kinds[fqn] = shape, kind
    return shapes, kinds


def layer_shapes(config) -> dict[str, LayerShape]:
    """FQN -> shape of every GEMM entry of ``config``'s model, every kind (``entries``)."""
    return entries(config)[0]


def plan_on(config, hw: Hardware | None = None, quantize_cfg=None) -> dict[str, LinearPlan]:
    """The plan of step 1 of ``config`` on ``hw`` (``run_of``; with ``quantize_cfg``: a fresh resolution)."""
    return (run_of(config, hw) if quantize_cfg is None else resolve_run(config, hw, quantize_cfg)).plans


def resolve_run(config, hw: Hardware | None = None, quantize_cfg=None) -> ResolvedRun:
    """The resolved run of ``config`` on ``hw`` (default: this machine's); the config is not changed.

    Args:
        config: the trainer config (its model tree before or after ``apply_run``).
        hw: the hardware to judge on (lbt-doctor ``--hardware``).
        quantize_cfg: a ``[quantize]`` section to use instead of ``config.quantize`` (doctor ``--recipe``).

    Raises:
        ConfigError: one line (``plan.resolve.resolve_plan``, ``plan.schedule``, ``plan.whatif``).
    """
    RESOLUTIONS[0] += 1
    hw = hw or detect_hardware()
    q = quantize_cfg or config.quantize
    shapes, kinds = entries(config)
    converted = {f: label for k in TARGETS for f, label in k.converted(config.model_spec.model).items()}
    schedule = resolve_schedule(q, shapes, config.training.steps, hw, converted)
    check_switchable(schedule, {f: k.what for f, k in kinds.items() if not k.switchable})
    linears = [f for f, k in kinds.items() if k is linear.KIND]  # what-if statistics: linear layers
    whatif = resolve_whatif(config.numerics, linears, True, shapes, schedule.at(1).plans)
    formats = (wire_spec(q.comm.all_gather, "all_gather"), wire_spec(q.comm.reduce_scatter, "reduce_scatter"))
    kept = saved.resolve(config, shapes, q)
    return ResolvedRun(hw, shapes, kinds, converted, schedule, whatif, formats, kept)


def apply_run(config, run: ResolvedRun | None = None) -> ResolvedRun:
    """Resolve ``config`` (unless ``run`` is given) and rewrite its model tree and spec for it, kind by kind
    (``TargetKind.convert``); remember the run as ``config``'s (``run_of``).

    Raises:
        ConfigError: one line, before the model is built.
    """
    run = run or resolve_run(config)
    for kind in TARGETS:
        kind.convert(config, run)
    _RUNS[id(config)] = (config, run)
    return run


def run_of(config, hw: Hardware | None = None) -> ResolvedRun:
    """The run ``apply_run`` resolved for this very config object (on ``hw``, when given: another hardware
    is resolved now, as is a config ``apply_run`` never saw)."""
    held = _RUNS.get(id(config))
    if held is not None and held[0] is config and hw in (None, held[1].hardware):
        return held[1]
    return resolve_run(config, hw)


def current_plans(config) -> tuple[dict[str, LinearPlan], dict[str, str]]:
    """The plan as the model config tree holds it, and what each entry builds, in model order.

    Returns:
        FQN -> LinearPlan and FQN -> module label (linears a torchtitan converter swapped included).
    """
    plans, labels = {}, {}
    for kind in TARGETS:
        for fqn, (plan, label) in kind.current(config.model_spec.model).items():
            plans[fqn], labels[fqn] = plan, label
    return plans, labels


def plan_text(
    run: ResolvedRun, plans: dict[str, LinearPlan], labels: dict[str, str], quantize
) -> tuple[str, list]:
    """The plan table (one per phase and the eval plan, each under its title, with a schedule), each followed
    by why layers do not run torchao's kernel on the run's hardware (``plan.table.fallbacks``), then
    the formats of what modules save for the backward (``[[quantize.saved]]``), and the schedule's JSON
    (empty without one).

    Args:
        quantize: the run's ``[quantize]`` section (its ``backend`` and ``torchao`` options).
    """

    def table(p: dict[str, LinearPlan]) -> str:
        why = fallbacks(p, run.shapes, run.hardware, quantize.backend, quantize.torchao)
        return format_plan(p, labels) + format_fallbacks(why, run.hardware, quantize.backend)

    sched = run.schedule
    saves = saved.format_saved(run.saved)
    if len(sched.all()) == 1:
        return table(plans) + saves, []
    parts, data = [], []
    for phase in sched.all():
        merged = {**plans, **phase.plans}  # keeps the linears a base's torchtitan converter swapped
        parts.append(f"\n== {phase_title(sched, phase)}\n{table(merged)}")
        last = sched.last_step(phase) if phase.first_step else 0
        rows = plan_to_json(merged, labels)
        data.append({"label": phase.label, "first_step": phase.first_step, "last_step": last, "plans": rows})
    return "".join(parts) + saves, data


def save_plan(config, folder: str | os.PathLike) -> Path:
    """Write ``precision_plan.txt`` (the table), ``precision_plan.json``, with a schedule
    ``precision_schedule.json``, and ``gemm_sizes.json`` into ``folder`` (each atomically); log the table.

    Returns:
        The path of the text table.
    """
    from torchtitan.tools.logging import logger

    run = run_of(config)
    plans, labels = current_plans(config)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    head = f"recipe={config.quantize.recipe} backend={config.quantize.backend} device={run.hardware}\n"
    table, schedule = plan_text(run, plans, labels, config.quantize)
    write_atomic(folder / PLAN_TEXT, head + table)
    write_atomic(folder / PLAN_JSON, json.dumps(plan_to_json(plans, labels), indent=1) + "\n")
    if schedule:
        write_atomic(folder / SCHEDULE_JSON, json.dumps(schedule, indent=1) + "\n")
    sizes = {f: [x.in_features, x.out_features, x.copies] for f, x in run.shapes.items()}
    write_atomic(folder / GEMM_SIZES_JSON, json.dumps(sizes, indent=1) + "\n")
    logger.info("Precision plan:\n" + head + table)
    return folder / PLAN_TEXT


def live(model_parts) -> list[tuple[str, QuantState]]:
    """``(plan entry, state module)`` of every quantized target of the built model, every kind."""
    return live_targets(model_parts)
