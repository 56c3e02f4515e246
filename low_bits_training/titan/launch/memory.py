"""The launcher's memory check: rank 0's peak planned (``titan/runtime/peak.py``) against the limit, before any
rank starts; a run over it is refused in one line naming the change that fits (``titan/runtime/peak_fit.py``)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch

from low_bits_training.config.memory import FREE_FRACTION
from low_bits_training.errors import ConfigError
from low_bits_training.run.folder import PEAK_PLAN_ENV
from low_bits_training.titan.launch.peak_cache import kept, plan_key
from low_bits_training.titan.launch.validate import model_as_trained
from low_bits_training.titan.platform.cpu import needs_cpu_adapters
from low_bits_training.titan.runtime.peak import NotPlanned, PeakPlan, gib
from low_bits_training.titan.runtime.peak_fit import in_child, plan_and_fit, ranked
from low_bits_training.titan.targets.registry import run_of


def free_memory() -> tuple[int, str]:
    """Bytes one rank may take on this machine and what they are: a GPU's free memory (its total less what
    NVML sees used; no CUDA context is made in the launcher), or on the CPU the host's available memory
    (``MemAvailable``). (0, why) where unknown."""
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        try:
            return total - torch.cuda.device_memory_used(0), "GPU 0's free memory"
        except (RuntimeError, ModuleNotFoundError, ImportError):  # no NVML: the total
            return total, "GPU 0's total memory"
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024, "the host's available memory"
    except (OSError, KeyError, ValueError):
        return 0, "unknown"


def refusal(plan: PeakPlan, limit: int, source: str, fits: list) -> str:
    """The one line of a run planned over ``FREE_FRACTION`` x ``limit``: its peak, its three largest parts,
    and the cheapest change found that fits (``cheapest_fit``)."""
    parts = ", ".join(f"{k} {gib(v)}" for k, v in plan.largest(3))
    line = (
        f"memory: rank 0 would peak at {gib(plan.peak)} GiB ({parts} GiB at the peak, in the {plan.phase}), "
        f"over {FREE_FRACTION} x {gib(limit)} GiB ({source})"
    )
    if fits and fits[-1][1].peak <= FREE_FRACTION * limit:
        changes, better = fits[-1]
        return f"{line}; {changes} plans {gib(better.peak)} GiB (or set memory.limit_gib or --memory.no-plan)"
    tried = "; ".join(changes for changes, _ in fits) or "none applies"
    return (
        f"{line}; no change tried fits ({tried}; lbt-doctor --fit plans every change): shard over more ranks"
    )


@dataclass
class PeakCheck:
    """What ``check_peak`` found for a run: its plan and the limit it was held to, or why it was not planned."""

    plan: PeakPlan | None
    limit: int = 0
    """Bytes one rank may use (0: none known)."""
    source: str = ""
    """Where ``limit`` comes from (``memory.limit_gib = 80``, ``the host's available memory``)."""
    why_not: str | None = None
    """Why there is no plan (``memory.plan = false``, pipeline parallelism, the planner's failure)."""
    enforced: bool = True
    """False on a GPU node without ``memory.limit_gib``: the plan runs attention as the CPU does (dense
    matrices where a GPU runs flash / flex kernels), so it is said, not enforced, until held to a GPU."""

    def line(self) -> str:
        """One line for the launcher's notes and lbt-doctor's ``peak memory`` row."""
        if self.plan is None:
            return f"not planned: {self.why_not}"
        held = f"; {FREE_FRACTION} x {gib(self.limit)} GiB allowed ({self.source})" if self.limit else ""
        if not self.enforced:
            held += "; not enforced on a GPU node yet (attention planned as the CPU runs it)"
        return f"{self.plan.summary()}{held}"


_CHECKS: dict[int, tuple[Any, PeakCheck]] = {}


def peak_check_of(config: Any) -> PeakCheck | None:
    """The ``PeakCheck`` ``check_peak`` made for this very config object (None: not checked)."""
    held = _CHECKS.get(id(config))
    return held[1] if held is not None and held[0] is config else None


def limit_of(config: Any, here: bool = True) -> tuple[int, str, str]:
    """``(bytes one rank may use, where that comes from, the device type planned for)``: ``memory.limit_gib``
    (planned as on CUDA when the ranks do not start here), else this machine's free memory (0 when not here)."""
    mem = config.memory
    device_type = "cuda" if torch.cuda.is_available() or (mem.limit_gib and not here) else "cpu"
    if mem.limit_gib:
        return int(mem.limit_gib * 2**30), f"memory.limit_gib = {mem.limit_gib:g}", device_type
    return (*free_memory(), device_type) if here else (0, "", device_type)


def fit_table(config: Any, world_size: int) -> str:
    """lbt-doctor ``--fit``: a markdown table of the run and each change ``peak_fit.ranked`` planned, ranked,
    against ``FREE_FRACTION`` of the limit (``limit_of``).

    Raises:
        NotPlanned: a run the planner does not plan.
    """
    limit, source, device_type = limit_of(config)
    allowed = int(FREE_FRACTION * limit) if limit else 1 << 62
    rows = in_child(ranked, config, world_size, allowed, device_type, model_as_trained)
    head = f"Planned peak of rank 0 against {FREE_FRACTION} x {gib(limit)} GiB ({source}):" if limit else ""
    out = [head, "", "| rank | change | planned peak (GiB) | largest parts | fits |", "|---|---|---|---|---|"]
    for i, (flags, plan, fits) in enumerate(rows, 1):
        parts = ", ".join(f"{k} {gib(v)}" for k, v in plan.largest(3))
        out.append(f"| {i} | `{flags}` | {gib(plan.peak)} | {parts} | {'yes' if fits else 'no'} |")
    return "\n".join(out).lstrip("\n")


_PLANS: dict[str, tuple] = {}


def _planned(config: Any, world_size: int, device_type: str, allowed: int) -> tuple[PeakPlan, list]:
    """``peak_fit.plan_and_fit`` in a forked child, once per process for the same run: the resolved config
    without what the planner never reads (``peak_cache.plan_key``), the hardware its precision plan was
    resolved on, the ranks, the device and the limit (lbt-doctor and the launcher's check in one process, or a
    test process that checks one config often); across processes too with ``LBT_PEAK_CACHE`` set
    (``peak_cache.kept``)."""
    key = plan_key(config, str(run_of(config).hardware), world_size, device_type, allowed)
    if key not in _PLANS:
        _PLANS[key] = kept(
            key, lambda: in_child(plan_and_fit, config, world_size, device_type, model_as_trained, allowed)
        )
    return _PLANS[key]


def check_peak(config: Any, world_size: int, here: bool = True, refuse: bool = True) -> PeakCheck:
    """Plan rank 0's peak (``titan/runtime/peak.py``, in a forked child) and refuse a run over
    ``FREE_FRACTION`` of the limit: ``memory.limit_gib``, or this machine's free memory when the ranks start
    here. The plan goes to the ranks (``PEAK_PLAN_ENV``), which log it beside what the allocator measures;
    the check is kept for ``peak_check_of``.

    ``refuse`` False (lbt-speed, which predicts): a run over the limit is planned and said, not refused.

    Raises:
        ConfigError: the run does not fit (``refusal``), before any rank starts.
    """
    mem = config.memory
    if not mem.plan:  # no free-memory read either (on a GPU node that would initialize CUDA here)
        found = PeakCheck(None, why_not="memory.plan = false")
    else:
        limit, source, device_type = limit_of(config, here)
        enforced = needs_cpu_adapters() or bool(mem.limit_gib)
        allowed = int(FREE_FRACTION * limit) if enforced else 0  # not enforced: no changes searched
        try:
            plan, fits = _planned(config, world_size, device_type, allowed)
        except NotPlanned as e:
            found = PeakCheck(None, limit, source, str(e).splitlines()[0])
        else:
            if refuse and allowed and plan.peak > allowed:
                raise ConfigError(refusal(plan, limit, source, fits))
            os.environ[PEAK_PLAN_ENV] = json.dumps(plan.to_json())
            found = PeakCheck(plan, limit, source, enforced=enforced)
    _CHECKS[id(config)] = (config, found)
    return found
