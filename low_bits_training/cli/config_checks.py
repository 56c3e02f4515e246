"""Checks that need the run's config: does it pass the launcher's own check, which backend runs each
linear layer on this hardware (the resolved plan: ``plan.backends.gemm_backend``, the answer the plan table
gives), does that combination suit torch.compile, are its data and tokenizer reachable, is there disk for its
checkpoints."""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from pathlib import Path
from typing import Any

from low_bits_training.cli.checks import Check, check_disk
from low_bits_training.nn import GEMMS
from low_bits_training.nn.hardware import Hardware
from low_bits_training.nn.torchao_recipes import torchao_recipe
from low_bits_training.plan.backends import gemm_backend, torchao_kernel_refusal

HUB_FREE_DATASETS = ("lbt_markov", "lbt_markov_validation")
_SLOW = ("emulate", "torchao_emulated")


def cpu_adapters_once() -> None:
    """The CPU adapters before the first torchtitan import (a no-op when they are in or not needed)."""
    import sys

    from low_bits_training.titan.platform import cpu

    tt = sys.modules.get("torchtitan.tools.utils")
    if cpu.needs_cpu_adapters() and getattr(tt, "device_type", None) != "cpu":
        cpu.install_device_module()


TOKENIZER_FREE = [
    *("--dataloader.dataset", "lbt_markov", "--dataloader.dataset_path", "./assets/lbt_markov"),
    *("--hf_assets_path", "./assets/lbt_markov"),
]
"""Overrides that resolve a preset whose tokenizer is not on this machine (8B / 70B presets without their
Hugging Face files): the built-in corpus as data, its tokenizer in place of the missing one. The model, its
vocabulary and its plan are the preset's (shapes need no tokenizer)."""


def checked_config(
    config_file: str | None, args: list[str], env: dict[str, str] | None = None, stand_in: bool = False
) -> tuple[Check, Any]:
    """Resolve and check the run with the launcher's own check (``titan.launch.launcher.check``: TOML,
    overrides, torchtitan's checks, the precision plan, datasets and tokenizer, value ranges, parallel degrees
    against ``NGPU`` processes, the checkpoint it would resume from); a refusal is a FAIL.

    Args:
        stand_in: where the launcher's only refusal is a missing tokenizer, resolve the run again with
            ``TOKENIZER_FREE`` and return that config with a WARN that says training would stop there
            (lbt-doctor and lbt-speed: the plan needs no tokenizer). Without it that refusal is a FAIL.

    Returns:
        The check and the built config (None when it did not resolve).
    """
    from low_bits_training.errors import ConfigError
    from low_bits_training.titan.launch.datasets import TokenizerMissing
    from low_bits_training.titan.launch.launcher import check
    from low_bits_training.titan.runtime.checkpoint import CheckpointError

    processes = _processes(env if env is not None else dict(os.environ))
    try:
        config, resume = check(
            (["--config-file", config_file] if config_file else []) + list(args), processes
        )
    except TokenizerMissing as e:
        if stand_in:
            return _stood_in(config_file, args, env, e)
        return Check("config", "FAIL", str(e), "fix the key named above"), None
    except ConfigError as e:
        return Check("config", "FAIL", str(e), "fix the key named above"), None
    except CheckpointError as e:
        return Check("config", "FAIL", f"checkpoint refused: {e}", "pick another dump_folder or fix it"), None
    except SystemExit:  # tyro rejected a flag (it printed why)
        return Check("config", "FAIL", f"bad command-line override in {args}", "see the message above"), None
    start = f"resumes from {resume}" if resume else "a fresh start"
    where = (
        f"{config_file or 'base'} -> {config.job.base}, dump_folder {config.dump_folder}, {processes} "
        f"process(es), {start}"
    )
    return Check("config", "OK", where), config


def _stood_in(
    config_file: str | None, args: list[str], env: dict[str, str] | None, missing: Exception
) -> tuple[Check, Any]:
    """``checked_config`` with the built-in corpus in place of the missing tokenizer: a WARN naming the
    launcher's refusal (or the stand-in's own FAIL)."""
    status, config = checked_config(config_file, [*args, *TOKENIZER_FREE], env)
    if config is None:
        return status, None
    detail = (
        f"{missing}: training stops here (the launcher exits 2); the rows below are this run with the "
        f"built-in corpus as data ({status.detail})"
    )
    fix = "put the model's HF tokenizer folder at hf_assets_path (--hf_assets_path DIR), or train on "
    return Check("config", "WARN", detail, fix + "--dataloader.dataset lbt_markov"), config


def _processes(env: dict[str, str]) -> int:
    """The processes ``run_llama_train.sh`` would start: ``NGPU``, else the visible GPUs, else 1."""
    if env.get("NGPU", "").isdigit() and int(env["NGPU"]) > 0:
        return int(env["NGPU"])
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def layer_backends(config: Any, hw: Hardware, quantize: Any = None) -> dict[str, tuple[str, tuple[str, ...]]]:
    """What runs each GEMM entry of the run on ``hw``: FQN -> (module label, backend per GEMM), in model
    order, every kind of target.

    The run the launcher trains (``titan.targets.registry.resolve_run``: the plan of step 1, a phase starting at
    step 0 included); entries a base's torchtitan converter swapped are ``torchtitan``.
    """
    from low_bits_training.titan.targets import registry

    run = registry.run_of(config, hw) if quantize is None else registry.resolve_run(config, hw, quantize)
    labels = run.labels()
    out = {fqn: (labels[fqn], tuple(gemm_backend(p, g) for g in GEMMS)) for fqn, p in run.plans.items()}
    for fqn in run.converted:
        out[fqn] = (labels[fqn], ("torchtitan",) * len(GEMMS))
    return out


def _slow_fix(config: Any, hw: Hardware, quantize: Any) -> str:
    from low_bits_training.titan.targets.registry import plan_on

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
    from low_bits_training.titan.targets.attention import UNCHANGED

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
    from low_bits_training.plan.table import fallbacks
    from low_bits_training.titan.targets import registry

    run = registry.run_of(config, hw)
    rows = fallbacks(run.plans, run.shapes, hw, config.quantize.backend, config.quantize.torchao)
    return [Check("fallback", "WARN", f"{', '.join(labels)}: {why}") for why, labels in rows]


def check_saved(config: Any, hw: Hardware) -> list[Check]:
    """One OK row for ``[[quantize.saved]]`` (none without rules): each format and the modules that keep
    their saves in it (the run resolved them: ``titan.targets.saved``)."""
    from low_bits_training.titan.targets import registry

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
    from low_bits_training.titan.targets import registry

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
    from low_bits_training.config.argv import flag_names
    from low_bits_training.titan.launch.configure import read_toml
    from low_bits_training.titan.runtime.graphs import graph_policy

    toml = read_toml(config_file).get("training", {}) if config_file else {}
    by_user = bool(toml.get("disable_cuda_graphs")) or "training.disable_cuda_graphs" in flag_names(args)
    return Check(
        "CUDA graphs",
        "OK",
        graph_policy(config, hw.kind == "cuda", by_user and config.training.disable_cuda_graphs),
    )


def check_dataset(config: Any, env: dict[str, str]) -> Check:
    """Local dataset paths exist; hub datasets need network (a FAIL when HF_HUB_OFFLINE=1)."""
    dl = config.dataloader
    name, path = getattr(dl, "dataset", ""), getattr(dl, "dataset_path", None)
    if name in HUB_FREE_DATASETS:
        return Check(
            "dataset", "OK", f"{name}: built locally in {path or './assets/lbt_markov'} (no network)"
        )
    if path:
        if glob_exists(path):
            return Check("dataset", "OK", f"{name}: local {path}")
        return Check(
            "dataset",
            "FAIL",
            f"{name}: dataloader.dataset_path = {path!r} does not exist",
            "point dataloader.dataset_path at your files",
        )
    if env.get("HF_HUB_OFFLINE") == "1" or env.get("HF_DATASETS_OFFLINE") == "1":
        return Check(
            "dataset",
            "FAIL",
            f"{name}: a hub dataset, but HF_HUB_OFFLINE=1",
            "download it first and set dataloader.dataset_path",
        )
    return Check(
        "dataset",
        "WARN",
        f"{name}: a HF hub name: needs network from every node",
        "pre-download and set dataloader.dataset_path for offline nodes",
    )


def glob_exists(path: str) -> bool:
    """A path, or a glob that matches something."""
    import glob

    return os.path.exists(path) or bool(glob.glob(path))


def check_tokenizer(config: Any) -> Check:
    """Where the tokenizer is (the launcher's validation already refused a folder without one)."""
    # the launcher's: one home
    from low_bits_training.titan.launch.datasets import TOKENIZER_FILES, tokenizer_file

    path = Path(config.hf_assets_path)
    found = tokenizer_file(path)
    if found is None:  # unreachable after build_config; kept so a future loader change cannot pass silently
        return Check(
            "tokenizer", "FAIL", f"hf_assets_path = {str(path)!r}: none of {', '.join(TOKENIZER_FILES)}"
        )
    return Check("tokenizer", "OK", str(found))


def state_budget(config: Any, env: dict[str, str]) -> tuple[Any, str | None]:
    """The run's training-state bytes computed from its config (``titan.runtime.budget.planned``: model and
    optimizers built on the meta device, ``NGPU`` processes), or None and why not."""
    from low_bits_training.titan.runtime.budget import planned

    try:
        return planned(config, _processes(env)), None
    except ValueError as e:  # an optimizer without a byte model
        return None, str(e)


def check_state_bytes(budget: Any, why: str | None) -> Check:
    """Bytes per parameter of each training state (params, grads, each optimizer state) and their formats."""
    if budget is None:
        return Check("state bytes", "WARN", f"not computed: {why}", "see docs/memory.md")
    per = budget.per_param()
    parts = ", ".join(
        f"{s} {v:.2f} ({'; '.join(budget.formats[s])})" for s, v in per.items() if s not in ("total", "step")
    )
    total = sum(budget.nbytes.values())
    head = f"{per['total']:.2f} B/param x {budget.numel / 1e6:.2f} M params = {total / 2**30:.2f} GiB on all ranks"
    return Check("state bytes", "OK", f"{head}: {parts}")


def checkpoint_bytes(config: Any, budget: Any) -> int | None:
    """Disk for the kept checkpoints: the parameters and optimizer states of ``budget`` (all but the
    gradients) per checkpoint."""
    if budget is None:
        return None
    ck = config.checkpoint
    count = config.training.steps // max(ck.interval, 1) + 1
    if ck.keep_latest_k > 0:
        count = min(count, ck.keep_latest_k)
    saved = sum(b for s, b in budget.nbytes.items() if s != "grads")
    return saved * max(count, 1)


def check_checkpoint_disk(config: Any, budget: Any) -> Check:
    """Free space where checkpoints go against what the kept checkpoints need."""
    if not config.checkpoint.enable:
        return Check("disk", "OK", "checkpointing off (a killed run cannot resume)")
    folder = Path(config.dump_folder) / config.checkpoint.folder
    return check_disk(folder, checkpoint_bytes(config, budget))


def _recipe_check(config: Any, hw: Hardware, recipe: str) -> Check:
    from low_bits_training.errors import ConfigError

    try:
        return check_backends(
            config, hw, dataclasses.replace(config.quantize, recipe=recipe), f"recipe {recipe}"
        )
    except ConfigError as e:
        return Check(f"recipe {recipe}", "FAIL", str(e), "fix the recipe or [quantize] rules")


def config_checks(
    config_file: str | None,
    args: list[str],
    env: dict[str, str],
    extra_recipes: list[str],
    hw: Hardware,
    more: tuple = (),
) -> tuple[list[Check], bool]:
    """All checks that need the config, judged on hardware ``hw``; ``more``: functions
    ``(config, hw) -> list[Check]`` of the callers' own (lbt-doctor's speed row), after the compile row.

    Returns:
        The checks and whether the config asks for W&B.
    """
    cpu_adapters_once()
    status, config = checked_config(config_file, args, env, stand_in=True)
    if config is None:
        return [status], False
    checks = [status, check_backends(config, hw), *check_fallbacks(config, hw), *check_saved(config, hw)]
    checks += check_autopilot(config, hw)
    checks.append(check_compile(config, hw))
    checks.append(check_cuda_graphs(config, hw, config_file, args))
    checks += [c for f in more for c in f(config, hw)]
    checks += [_recipe_check(config, hw, r) for r in dict.fromkeys(extra_recipes)]
    budget, why = state_budget(config, env)
    checks.append(check_state_bytes(budget, why))
    if status.status == "OK":  # else the config row says the tokenizer is missing; data is the stand-in's
        checks += [check_tokenizer(config), check_dataset(config, env)]
    checks.append(check_checkpoint_disk(config, budget))
    return checks, bool(config.metrics.enable_wandb)
