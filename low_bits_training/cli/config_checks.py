"""lbt-doctor's config checks: resolve the run with the launcher's own check (``checked_config``), then every
row that needs its config (``config_checks``: the plan rows of ``cli.plan_checks``, the resource rows of
``cli.resource_checks``)."""

from __future__ import annotations

import os
from typing import Any

from low_bits_training.cli.checks import Check
from low_bits_training.cli.plan_checks import (
    check_autopilot,
    check_backends,
    check_compile,
    check_cuda_graphs,
    check_fallbacks,
    check_saved,
    recipe_check,
)
from low_bits_training.cli.resource_checks import (
    check_checkpoint_disk,
    check_dataset,
    check_peak_memory,
    check_state_bytes,
    check_tokenizer,
)
from low_bits_training.errors import ConfigError
from low_bits_training.nn.hardware import Hardware
from low_bits_training.titan.launch.datasets import TokenizerMissing
from low_bits_training.titan.launch.launcher import check
from low_bits_training.titan.launch.memory import fit_table
from low_bits_training.titan.runtime.budget import planned
from low_bits_training.titan.runtime.checkpoint import CheckpointError
from low_bits_training.titan.runtime.peak import NotPlanned

TOKENIZER_FREE = [
    *("--dataloader.dataset", "lbt_markov", "--dataloader.dataset_path", "./assets/lbt_markov"),
    *("--hf_assets_path", "./assets/lbt_markov"),
]
"""Overrides that resolve a preset whose tokenizer is not on this machine (8B / 70B presets without their
Hugging Face files): the built-in corpus as data, its tokenizer in place of the missing one. The model, its
vocabulary and its plan are the preset's (shapes need no tokenizer)."""


def checked_config(
    config_file: str | None,
    args: list[str],
    env: dict[str, str] | None = None,
    stand_in: bool = False,
    here: bool = True,
) -> tuple[Check, Any]:
    """Resolve and check the run with the launcher's own check (``titan.launch.launcher.check``: TOML,
    overrides, torchtitan's checks, the precision plan, datasets and tokenizer, value ranges, parallel degrees
    against ``NGPU`` processes, the checkpoint it would resume from); a refusal is a FAIL.

    Args:
        stand_in: where the launcher's only refusal is a missing tokenizer, resolve the run again with
            ``TOKENIZER_FREE`` and return that config with a WARN that says training would stop there
            (lbt-doctor and lbt-speed: the plan needs no tokenizer). Without it that refusal is a FAIL.
        here: the ranks would start on this machine (``launcher.check``'s ``here``); False for named hardware.

    Returns:
        The check and the built config (None when it did not resolve).
    """
    processes = _processes(env if env is not None else dict(os.environ))
    try:
        config, resume = check(
            (["--config-file", config_file] if config_file else []) + list(args), processes, here
        )
    except TokenizerMissing as e:
        if stand_in:
            return _stood_in(config_file, args, env, e, here)
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
    config_file: str | None, args: list[str], env: dict[str, str] | None, missing: Exception, here: bool
) -> tuple[Check, Any]:
    """``checked_config`` with the built-in corpus in place of the missing tokenizer: a WARN naming the
    launcher's refusal (or the stand-in's own FAIL)."""
    status, config = checked_config(config_file, [*args, *TOKENIZER_FREE], env, here=here)
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


def state_budget(config: Any, env: dict[str, str]) -> tuple[Any, str | None]:
    """The run's training-state bytes computed from its config (``titan.runtime.budget.planned``: model and
    optimizers built on the meta device, ``NGPU`` processes), or None and why not."""
    try:
        return planned(config, _processes(env)), None
    except ValueError as e:  # an optimizer without a byte model
        return None, str(e)


def config_checks(
    config_file: str | None,
    args: list[str],
    env: dict[str, str],
    extra_recipes: list[str],
    hw: Hardware,
    more: tuple = (),
    here: bool = True,
) -> tuple[list[Check], bool]:
    """All checks that need the config, judged on hardware ``hw``; ``more``: functions
    ``(config, hw) -> list[Check]`` of the callers' own (lbt-doctor's speed row), after the compile row.

    Returns:
        The checks and whether the config asks for W&B.
    """
    status, config = checked_config(config_file, args, env, stand_in=True, here=here)
    if config is None:
        return [status], False
    try:
        checks = [status, check_backends(config, hw), *check_fallbacks(config, hw), *check_saved(config, hw)]
    except ConfigError as e:  # the plan resolves here but not on the named hardware (backend = 'torchao')
        return [status, Check("backends", "FAIL", f"on {hw}: {e}", "fix the key named above")], False
    checks += check_autopilot(config, hw)
    checks.append(check_compile(config, hw))
    checks.append(check_cuda_graphs(config, hw, config_file, args))
    checks += [c for f in more for c in f(config, hw)]
    checks += [recipe_check(config, hw, r) for r in dict.fromkeys(extra_recipes)]
    budget, why = state_budget(config, env)
    checks.append(check_state_bytes(budget, why))
    checks.append(check_peak_memory(config))
    if status.status == "OK":  # else the config row says the tokenizer is missing; data is the stand-in's
        checks += [check_tokenizer(config), check_dataset(config, env)]
    checks.append(check_checkpoint_disk(config, budget))
    return checks, bool(config.metrics.enable_wandb)


def fit_report(config_file: str, args: list[str], env) -> str:
    """lbt-doctor ``--fit``: the run resolved with its memory check off (a run over the limit is the point
    here), then ``launch.memory.fit_table``; or one line saying why there is none."""
    status, config = checked_config(config_file, [*args, "--memory.no-plan"], dict(env), stand_in=True)
    if config is None:
        return f"peak memory: no ranking: {status.detail}"
    try:
        return fit_table(config, _processes(dict(env)))
    except NotPlanned as e:
        return f"peak memory: no ranking: {str(e).splitlines()[0]}"
