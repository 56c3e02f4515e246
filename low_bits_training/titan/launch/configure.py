"""TOML -> torchtitan config tree. Precedence: base function < TOML file < command-line flags.

A TOML file names a base (``[job] base = "llama3:llama3_debugmodel"``) and then sets any field of the
``Trainer.Config`` tree by its section path, as torchtitan's own CLI names it (``[training] steps = 20``,
``[parallelism] data_parallel_shard_degree = 2``, ``[lr_scheduler] warmup_steps = 5``). Command-line flags
(``--training.steps 4``) come last, parsed by tyro exactly as ``torchtitan.train`` parses them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomli_w

from low_bits_training.config.argv import flag_names, flag_value
from low_bits_training.config.flags import (
    NO_PARSER,
    refused_choice,
    table_flags,
    tyro_message,
    unknown_flag,
    unparsable_flag,
)
from low_bits_training.config.job import BASE_SHAPE, JobConfig
from low_bits_training.config.tree import apply_dict, diff
from low_bits_training.errors import ConfigError
from low_bits_training.run.folder import COMMAND_TXT, CONFIG_JSON, CONFIG_TOML, write_atomic
from low_bits_training.run.secrets import redact, redact_argv, wandb_credentials
from low_bits_training.titan.platform.compat import config_function, config_manager
from low_bits_training.titan.runtime.checkpoint import LowBitsCheckpointManager
from low_bits_training.titan.runtime.metrics import LowBitsMetricsProcessor
from low_bits_training.titan.runtime.trainer import LowBitsTrainer


def read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a TOML file.

    Raises:
        ConfigError: one line when it is missing, not a file, not UTF-8 text, not TOML, or empty (an empty
            file would silently mean the default base with torchtitan's defaults).
    """
    where = f"CONFIG_FILE = {str(path)!r}"
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{where}: a folder, expected a TOML file") from None
    except PermissionError:
        raise ConfigError(f"{where}: not readable (permission denied)") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not a text file (TOML is UTF-8 text); is it the right file?") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where}: not valid TOML: {e}") from None
    if not data:
        raise ConfigError(
            f"{where}: empty (no keys); expected at least [job] base = 'module:function', "
            "see train_configs/debug_model.toml"
        )
    return data


def resolve_base(base: str) -> LowBitsTrainer.Config:
    """Call the base config function named ``module:function`` and return it as our config class.

    Raises:
        ConfigError: malformed name, unknown module or function, or a function that returns no config.
    """
    BASE_SHAPE.check("job.base", base)
    module, _, fn = base.partition(":")
    try:
        cfg = config_function(module, fn)
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


def wandb_configured(env: dict[str, str] | None = None) -> bool:
    """True when the user has set W&B up (``run.secrets.wandb_credentials``, the one test)."""
    return wandb_credentials(os.environ if env is None else env) is not None


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
    base = flag_value(cli_args, "job.base") or job.base
    config = resolve_base(base)
    config.metrics.enable_wandb = config.metrics.enable_wandb or wandb_configured()
    if platform_defaults is not None:
        platform_defaults(config)
    apply_dict(config, data)
    config.job.base = base
    config = parse_cli(config, cli_args)
    folder = config.job.run_folder()  # [job] name from the TOML or --job.name: the flags are in by now
    if folder and "dump_folder" not in data and "dump_folder" not in flag_names(cli_args):
        config.dump_folder = folder
    return config


def parse_cli(config: LowBitsTrainer.Config, args: list[str]) -> LowBitsTrainer.Config:
    """Apply torchtitan-style command-line flags on top of ``config`` (tyro, torchtitan's rules).

    ``--help`` prints tyro's help and exits (SystemExit 0), as torchtitan's own entry point does. Flags of
    fields tyro cannot take as ``--a.b value`` are applied first, as the TOML loader applies them
    (``table_flags``).

    Raises:
        ConfigError: a flag tyro refuses, in one line naming the flag (tyro's own message is a framed box).
    """
    if not args:
        return config
    if "--help" in args or "-h" in args:
        return _tyro(config, args)
    args = table_flags(config, args)
    out = io.StringIO()
    try:
        with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
            return _tyro(config, args) if args else config
    except SystemExit:
        message = unknown_flag(config, args) or refused_choice(config, args) or tyro_message(out.getvalue())
        if message.startswith(f"command line: {NO_PARSER}"):
            message = unparsable_flag(lambda a: _tyro(config, a), args) or message
        raise ConfigError(message) from None


def _tyro(config: LowBitsTrainer.Config, args: list[str]) -> LowBitsTrainer.Config:
    import tyro
    from torchtitan.config.manager import custom_registry

    config_manager()  # torchtitan's tyro rules are registered when it is made
    return tyro.cli(type(config), args=args, default=config, registry=custom_registry)


def save_resolved(config: LowBitsTrainer.Config, folder: str | os.PathLike, argv: list[str]) -> Path:
    """Write ``config.toml`` (base + every field that differs from it: rerunnable), ``config.json`` (the
    whole tree) and ``command.txt`` into ``folder``, each through a temporary name and a rename (a killed
    write never leaves half a file in place of the previous run's).

    Call it once the run has really started (the launcher does, after the checkpoint loaded): a run refused
    before that must leave the folder's files, which rerun the previous run, as they were.

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
    write_atomic(folder / CONFIG_TOML, header + body)
    write_atomic(folder / CONFIG_JSON, json.dumps(redact(config.to_dict()), indent=2, default=repr) + "\n")
    write_atomic(folder / COMMAND_TXT, " ".join(redact_argv(argv)) + "\n")
    return folder / CONFIG_TOML


def _pop_untomlable(d: dict[str, Any], where: str = "") -> list[str]:
    lost = [f"{where}.{n}" if where else n for n in d.pop("__untomlable__", [])]
    for k, v in d.items():
        if isinstance(v, dict):
            lost += _pop_untomlable(v, f"{where}.{k}" if where else k)
    return lost


# python -m low_bits_training.titan.launch.configure x.toml [flags]: print the result
if __name__ == "__main__":
    print(json.dumps(load_config(sys.argv[1], sys.argv[2:]).to_dict(), indent=2, default=repr))
