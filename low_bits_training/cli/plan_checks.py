"""lbt-doctor's plan rows: which backend runs each GEMM entry of the run on the hardware (the resolved plan:
``plan.backends.gemm_backend``, the answer the plan table gives), why a group falls back from torchao's
kernels, the saved-activation formats, the autopilot, and whether that combination suits torch.compile and
CUDA graphs."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from low_bits_training.cli.checks import Check
from low_bits_training.config.argv import flag_names
from low_bits_training.errors import ConfigError
from low_bits_training.nn import GEMMS
from low_bits_training.nn.hardware import Hardware
from low_bits_training.nn.torchao_recipes import torchao_recipe
from low_bits_training.plan.backends import gemm_backend, torchao_kernel_refusal
from low_bits_training.plan.table import fallbacks
from low_bits_training.titan.launch.configure import read_toml
from low_bits_training.titan.runtime.graphs import graph_policy
from low_bits_training.titan.targets import registry
from low_bits_training.titan.targets.attention import UNCHANGED
from low_bits_training.titan.targets.registry import plan_on

_SLOW = ("emulate", "torchao_emulated")


def layer_backends(config: Any, hw: Hardware, quantize: Any = None) -> dict[str, tuple[str, tuple[str, ...]]]:
    """What runs each GEMM entry of the run on ``hw``: FQN -> (module label, backend per GEMM), in model
    order, every kind of target.

    The run the launcher trains (``titan.targets.registry.resolve_run``: the plan of step 1, a phase starting at
    step 0 included); entries a base's torchtitan converter swapped are ``torchtitan``.
    """
    run = registry.run_of(config, hw) if quantize is None else registry.resolve_run(config, hw, quantize)
    labels = run.labels()
    out = {fqn: (labels[fqn], tuple(gemm_backend(p, g) for g in GEMMS)) for fqn, p in run.plans.items()}
    for fqn in run.converted:
        out[fqn] = (labels[fqn], ("torchtitan",) * len(GEMMS))
    return out


def _slow_fix(config: Any, hw: Hardware, quantize: Any) -> str:
    if hw.kind == "cpu":
        return "CPU: numerics are exact, speed is not a GPU's"
    plans = plan_on(config, hw, quantize)
    recipe = next((r for p in plans.values() if (r := torchao_recipe(p)) is not None), None)
    why = torchao_kernel_refusal(recipe, hw) if recipe is not None else None
    if why:
        return f"{why}: run on newer GPUs, or accept emulated speed"
    return "no torchao module computes these plans (docs/precision_plan.md): speed is emulation's"


def check_backends(config: Any, hw: Hardware, quantize: Any = None, name: str = "backends") -> Check:
    """Which backend runs the run's linears on ``hw``; WARN where a quantized GEMM is emulated (ours, or
    torchao's emulated mode), with the reason (the hardware lacks the kernel, or torchao has no such module).

    Raises:
        ConfigError: the plan does not resolve (see ``plan.resolve.resolve_plan``).
    """
    # attention the plan leaves alone is not listed (it runs as it would without this package)
    rows = {f: r for f, r in layer_backends(config, hw, quantize).items() if r[0] != UNCHANGED}
    counts = Counter((label, "/".join(dict.fromkeys(b))) for label, b in rows.values())
    detail = f"on {hw}: " + "; ".join(f"{n} x {label} [{b}]" for (label, b), n in counts.items())
    if any(b in _SLOW for _, bs in rows.values() for b in bs):
        return Check(name, "WARN", detail, _slow_fix(config, hw, quantize))
    return Check(name, "OK", detail)


def check_fallbacks(config: Any, hw: Hardware) -> list[Check]:
    """One WARN row per reason a group of the run's layers does not run torchao's kernel on ``hw``
    (``plan.table.fallbacks``: the lines under the plan table, from ``backends.fallback_reason``)."""
    run = registry.run_of(config, hw)
    rows = fallbacks(run.plans, run.shapes, hw, config.quantize.backend, config.quantize.torchao)
    return [Check("fallback", "WARN", f"{', '.join(labels)}: {why}") for why, labels in rows]


def check_saved(config: Any, hw: Hardware) -> list[Check]:
    """One OK row for ``[[quantize.saved]]`` (none without rules): each format and the modules that keep
    their saves in it (the run resolved them: ``titan.targets.saved``)."""
    by_format: dict[str, list[str]] = {}
    for fqn, fmt in registry.run_of(config, hw).saved.items():
        by_format.setdefault(fmt.label, []).append(fqn)
    if not by_format:
        return []
    detail = "; ".join(
        f"{label}: {len(m)} modules ({m[0]}{' ...' if len(m) > 1 else ''})" for label, m in by_format.items()
    )
    return [Check("saved", "OK", detail + " (parameters, softmax statistics and small tensors kept as made)")]


def check_autopilot(config: Any, hw: Hardware) -> list[Check]:
    """One row for ``[quantize.autopilot]`` (none when off): its ladder and triggers, and how many quantized
    linear layers it can promote (ours: a layer torchao runs cannot take another plan mid-run); WARN when
    that is none."""
    pilot = config.quantize.autopilot
    if not pilot.enable:
        return []
    run = registry.run_of(config, hw)
    ours = [
        fqn
        for fqn, plan in run.plans.items()
        if run.switchable(fqn)
        and not plan.is_high_precision
        and all(b in ("emulate", "real") for b in plan.backends)
    ]
    fired = [("nonfinite", pilot.nonfinite), (f"saturation > {pilot.saturation:g}", pilot.saturation)]
    fired += [
        (f"underflow > {pilot.underflow:g}", pilot.underflow),
        (f"SQNR < {pilot.sqnr_db:g} dB", pilot.sqnr_db),
    ]
    fired.append(
        (
            f"loss / grad-norm spike > {pilot.spike_z:g} sd (host snapshots every {pilot.snapshot_every} steps, "
            f"then {pilot.on_spike})",
            pilot.spike_z,
        )
    )
    detail = (
        f"ladder {' -> '.join(pilot.ladder)}; triggers: {', '.join(n for n, on in fired if on) or 'none'}"
    )
    if not ours:
        fix = 'quantize some layer with backend = "emulate" or "auto" (not torchao), or turn it off'
        return [Check("autopilot", "WARN", f"{detail}; no quantized target of ours to promote", fix)]
    kinds = Counter(run.kinds[fqn].name for fqn in ours)
    each = ", ".join(f"{n} {kind}" for kind, n in kinds.items())
    return [Check("autopilot", "OK", f"{detail}; watches {len(ours)} quantized targets ({each})")]


def check_compile(config: Any, hw: Hardware) -> Check:
    """torch.compile against the backends: torchao's kernels want it; torchao's emulated mode on a GPU with
    compile is what torchtitan refuses (it runs on a CPU with torch 2.14.1, tested; untested on GPUs)."""
    on = config.compile.enable and "model" in config.compile.components
    backends = {b for _, bs in layer_backends(config, hw).values() for b in bs}
    if "torchao" in backends and not on:
        return Check(
            "compile",
            "WARN",
            "off, with torchao kernels",
            "enable [compile] (torchao's kernels are fast only compiled)",
        )
    if on and "torchao_emulated" in backends and hw.kind == "cuda":
        why = (
            "torchao's emulated mode under torch.compile on a GPU is refused by torchtitan and untested here"
        )
        return Check("compile", "WARN", why, "use quantize.backend = 'auto' (our emulation compiles)")
    return Check("compile", "OK", "on" if on else "off")


def check_cuda_graphs(config: Any, hw: Hardware, config_file: str | None, args: list[str]) -> Check:
    """The CUDA-graph policy the run gets on ``hw`` (``titan/runtime/graphs.py``: on, or off and why)."""
    toml = read_toml(config_file).get("training", {}) if config_file else {}
    by_user = bool(toml.get("disable_cuda_graphs")) or "training.disable_cuda_graphs" in flag_names(args)
    return Check(
        "CUDA graphs",
        "OK",
        graph_policy(config, hw.kind == "cuda", by_user and config.training.disable_cuda_graphs),
    )


def recipe_check(config: Any, hw: Hardware, recipe: str) -> Check:
    try:
        return check_backends(
            config, hw, dataclasses.replace(config.quantize, recipe=recipe), f"recipe {recipe}"
        )
    except ConfigError as e:
        return Check(f"recipe {recipe}", "FAIL", str(e), "fix the recipe or [quantize] rules")
