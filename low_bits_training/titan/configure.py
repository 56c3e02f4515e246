"""TOML -> torchtitan config tree. Precedence: base function < TOML file < command-line flags.

A TOML file names a base (``[job] base = "llama3:llama3_debugmodel"``) and then sets any field of the
``Trainer.Config`` tree by its section path, as torchtitan's own CLI names it (``[training] steps = 20``,
``[parallelism] data_parallel_shard_degree = 2``, ``[lr_scheduler] warmup_steps = 5``). Command-line flags
(``--training.steps 4``) come last, parsed by tyro exactly as ``torchtitan.train`` parses them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomli_w

from low_bits_training.config.secrets import redact, redact_argv
from low_bits_training.config.tree import ConfigError, apply_dict, diff
from low_bits_training.titan.checkpoint import LowBitsCheckpointManager
from low_bits_training.titan.metrics import LowBitsMetricsProcessor
from low_bits_training.titan.trainer import JobConfig, LowBitsTrainer

DEFAULT_BASE = JobConfig().base


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a TOML file. Raises ConfigError (one line) when it is missing or not TOML."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"CONFIG_FILE = {str(path)!r}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"CONFIG_FILE = {str(path)!r}: not valid TOML: {e}") from None


@functools.cache
def _config_manager():
    from torchtitan.config.manager import ConfigManager

    return ConfigManager()  # registers torchtitan's tyro rules once


def resolve_base(base: str) -> LowBitsTrainer.Config:
    """Call the base config function named ``module:function`` and return it as our config class.

    Raises:
        ConfigError: malformed name, unknown module or function, or a function that returns no config.
    """
    module, sep, fn = base.partition(":")
    if not sep or not module or not fn:
        raise ConfigError(f"job.base = {base!r}: expected 'module:function', e.g. {DEFAULT_BASE!r}")
    try:  # ConfigManager._load_config resolves torchtitan short names and dotted modules alike
        cfg, _ = _config_manager()._load_config(["--module", module, "--config", fn])
    except (ValueError, ImportError, TypeError) as e:  # TypeError: a function that needs arguments
        raise ConfigError(f"job.base = {base!r}: {str(e).splitlines()[0]}") from None
    from torchtitan.trainer import Trainer

    if not isinstance(cfg, Trainer.Config):
        raise ConfigError(f"job.base = {base!r}: returned {type(cfg).__name__}, not a Trainer.Config")
    cfg = upgrade(cfg, LowBitsTrainer.Config)
    cfg.metrics = upgrade(cfg.metrics, LowBitsMetricsProcessor.Config)
    cfg.checkpoint = upgrade(cfg.checkpoint, LowBitsCheckpointManager.Config)
    return cfg


def upgrade(cfg: Any, cls: type) -> Any:
    """``cfg`` as an instance of its subclass ``cls`` (same field values, the subclass's extra defaults)."""
    if isinstance(cfg, cls):
        return cfg
    return cls(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init})


def _cli_base(args: list[str]) -> str | None:
    for i, a in enumerate(args):
        if a.startswith("--job.base="):
            return a.split("=", 1)[1]
        if a == "--job.base" and i + 1 < len(args):
            return args[i + 1]
    return None


def wandb_configured(env: dict[str, str] | None = None) -> bool:
    """True when the user has set W&B up: an API key, an explicit mode, or a netrc entry for its host."""
    env = os.environ if env is None else env
    if env.get("WANDB_API_KEY") or env.get("WANDB_MODE"):
        return True
    netrc = Path(env.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def load_config(
    config_file: str | os.PathLike | None,
    cli_args: list[str],
    platform_defaults: Callable[[Any], None] | None = None,
) -> LowBitsTrainer.Config:
    """Build the full config: base, then the TOML file, then the command line.

    Args:
        config_file: TOML path, or None for the base alone.
        cli_args: torchtitan-style flags (``--training.steps 4``).
        platform_defaults: applied to the base before the TOML (e.g. CPU-only defaults).

    Returns:
        The resolved ``LowBitsTrainer.Config`` (not yet adapted to the CPU, see ``cpu.adapt_trainer_config``).

    Raises:
        ConfigError: a one-line reason, before anything is built.
    """
    data = read_toml(config_file) if config_file else {}
    job = JobConfig()
    apply_dict(job, data.get("job", {}), "job")
    base = _cli_base(cli_args) or job.base
    config = resolve_base(base)
    config.metrics.enable_wandb = config.metrics.enable_wandb or wandb_configured()
    if platform_defaults is not None:
        platform_defaults(config)
    apply_dict(config, data)
    config.job.base = base
    if config.job.name and "dump_folder" not in data:
        config.dump_folder = os.path.join("outputs", config.job.name)
    return parse_cli(config, cli_args)


def parse_cli(config: LowBitsTrainer.Config, args: list[str]) -> LowBitsTrainer.Config:
    """Apply torchtitan-style command-line flags on top of ``config`` (tyro, torchtitan's rules)."""
    if not args:
        return config
    import tyro
    from torchtitan.config.manager import custom_registry

    _config_manager()
    return tyro.cli(type(config), args=args, default=config, registry=custom_registry)


def save_resolved(config: LowBitsTrainer.Config, folder: str | os.PathLike, argv: list[str]) -> Path:
    """Write ``config.toml`` (base + every field that differs from it: rerunnable), ``config.json`` (the
    whole tree) and ``command.txt`` into ``folder``.

    Returns:
        The path of ``config.toml``.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    changed = diff(config, resolve_base(config.job.base), skip=frozenset({"model_spec"}))
    changed.setdefault("job", {})["base"] = config.job.base
    lost = _pop_untomlable(changed)
    header = (
        "# Resolved by low-bits-training: the base plus every field that differs from it.\n"
        "# Rerun: CONFIG_FILE=<this file> ./run_llama_train.sh\n"
    )
    header += "".join(f"# not representable in TOML (left at the base's value): {k}\n" for k in lost)
    body = tomli_w.dumps(redact(changed))
    (folder / "config.toml").write_text(header + body)
    (folder / "config.json").write_text(json.dumps(redact(config.to_dict()), indent=2, default=repr) + "\n")
    (folder / "command.txt").write_text(" ".join(redact_argv(argv)) + "\n")
    return folder / "config.toml"


def _pop_untomlable(d: dict[str, Any], where: str = "") -> list[str]:
    lost = [f"{where}.{n}" if where else n for n in d.pop("__untomlable__", [])]
    for k, v in d.items():
        if isinstance(v, dict):
            lost += _pop_untomlable(v, f"{where}.{k}" if where else k)
    return lost


if __name__ == "__main__":  # python -m low_bits_training.titan.configure x.toml [flags]: print the result
    print(json.dumps(load_config(sys.argv[1], sys.argv[2:]).to_dict(), indent=2, default=repr))
