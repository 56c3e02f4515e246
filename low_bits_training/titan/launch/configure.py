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
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tomli_w

from low_bits_training.config.argv import flag_names, flag_value, scan
from low_bits_training.config.fields import coerce, field_types, literal_choices, named_choices, public_fields
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
        if message.startswith(f"command line: {_NO_PARSER}"):
            message = unparsable_flag(config, args) or message
        raise ConfigError(message) from None


def _tyro(config: LowBitsTrainer.Config, args: list[str]) -> LowBitsTrainer.Config:
    import tyro
    from torchtitan.config.manager import custom_registry

    config_manager()  # torchtitan's tyro rules are registered when it is made
    return tyro.cli(type(config), args=args, default=config, registry=custom_registry)


_NO_PARSER = "Could not create CLI parser"
"""How tyro's message starts when it fails before it parses (it names a type, not the flag)."""


def _field_at(config: Any, name: str) -> tuple[Any, str, Any, str, str | None] | None:
    """Where a flag lands: ``(parent dataclass, field name, annotation, parent's section path, the choice
    field the path runs through or None)``; None when the path names no field of a dataclass (the parent
    may be None: a choice set to ``none``)."""
    *path, last = name.replace("-", "_").split(".")
    parent, through = config, None
    for i, part in enumerate(path):
        if dataclasses.is_dataclass(parent) and named_choices(field_types(type(parent)).get(part)):
            through = ".".join(path[: i + 1])
        parent = getattr(parent, part, None)
    if through is not None and parent is None:
        return None, last, field_types(type(config)).get(through.split(".")[0]), ".".join(path), through
    if not dataclasses.is_dataclass(parent) or isinstance(parent, type):
        return None
    return parent, last, field_types(type(parent)).get(last, Any), ".".join(path), through


def _is_table_list(tp: Any) -> bool:
    # list[SomeDataclass], possibly inside Annotated / Optional: TOML's array of tables
    if typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    members = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    for m in members:
        args = typing.get_args(m) if typing.get_origin(m) is list else ()
        if args and isinstance(args[0], type) and dataclasses.is_dataclass(args[0]):
            return True
    return False


def table_flags(config: Any, args: list[str]) -> list[str]:
    """Apply the flags tyro cannot take in torchtitan's ``--a.b value`` form as the TOML loader applies the
    same key (``config.tree.apply_dict``), and return argv without them:

    - a named choice (``--activation_checkpoint selective``; tyro itself wants the subcommand token
      ``activation-checkpoint:selective``, which still works alone);
    - a field of the chosen one (``--activation_checkpoint.preserve_rng_state false``: tyro fails to build
      its parser for any flag after a subcommand token here);
    - a list of tables, given as a TOML inline array (``--quantize.rules '[]'``,
      ``--quantize.rules '[{layers = ["layers.*"], format = "e4m3"}]'``).

    Raises:
        ConfigError: a value the field refuses, or a field the choice does not have, naming the flag's key.
    """
    args = _subcommand_tokens(config, args)
    drop: set[int] = set()
    for flag in scan(args):
        found = _field_at(config, flag.name)
        if found is None or len(flag.values) != 1:
            continue
        parent, last, tp, where, through = found
        key = f"{where}.{last}" if where else last
        if through is not None:
            value = _choice_field_value(parent, last, tp, key, through, flag.values[0])
        elif named_choices(tp):
            value = flag.values[0]
        elif _is_table_list(tp):
            value = _toml_value(key, flag.values[0])
        else:
            continue
        apply_dict(parent, {last: value}, where)
        drop.update(range(flag.start, flag.end))
    return [a for i, a in enumerate(args) if i not in drop]


def _subcommand_tokens(config: Any, args: list[str]) -> list[str]:
    # tyro's own spelling of a choice, ``activation-checkpoint:selective``: applied like the flag form, so
    # the choice's fields may follow as flags (tyro cannot take them after the token here).
    out = []
    for token in args:
        name, sep, choice = token.partition(":")
        found = _field_at(config, name) if sep and not token.startswith("-") and "/" not in token else None
        if found is not None and found[4] is None and choice in named_choices(found[2]):
            apply_dict(found[0], {found[1]: choice}, found[3])
        else:
            out.append(token)
    return out


def _choice_field_value(parent: Any, last: str, tp: Any, key: str, through: str, text: str) -> Any:
    # A field of a chosen config (``activation_checkpoint.debug``): its value from the command-line text.
    if parent is None:  # tp: the top-level choice field's annotation (see _field_at)
        names = ", ".join(repr(n) for n in named_choices(tp))
        raise ConfigError(
            f"--{key}: {through} is 'none'; choose one of {names} first (--{through} <name>), then give "
            f"its fields as --{through}.<field> <value>"
        )
    allowed = public_fields(parent)
    if last not in allowed:
        raise ConfigError(
            f"unknown flag '--{key}'; allowed keys in [{through}] ({type(parent).__qualname__}): "
            f"{', '.join(sorted(allowed))}"
        )
    try:
        return coerce(text, tp, key)  # strings and string choices as given
    except ConfigError:
        literal = text.lower() if text in ("True", "False") else text  # tyro's spelling of booleans
        try:
            return tomllib.loads(f"v = {literal}")["v"]  # numbers, booleans, arrays; apply_dict checks
        except tomllib.TOMLDecodeError:
            return text  # apply_dict refuses it in the TOML loader's words


def _toml_value(key: str, text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(
            f'--{key} {text!r}: expected a TOML inline array of tables, e.g. \'[{{layers = ["layers.*"], '
            f'format = "e4m3"}}]\' (or write [[{key}]] tables in the TOML file)'
        ) from None


def unparsable_flag(config: Any, args: list[str]) -> str | None:
    """The first flag tyro refuses on its own, as one line naming it (None: each parses alone).

    For tyro's failures that name no flag: with this config tree, tyro's error report itself fails to build
    its parser (``Could not create CLI parser ...``, about ``quantize.rules``' type) for any refused value, so
    each flag is tried alone to find the one it refused.
    """
    for flag in scan(args):
        out = io.StringIO()
        try:
            with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
                _tyro(config, args[flag.start : flag.end])
        except SystemExit:
            given = " ".join(args[flag.start : flag.end])
            return (
                f"command line: {given}: refused (a value this flag does not take, or the wrong number of "
                "values; --help lists each flag's type, or set the key in the TOML file)"
            )
    return None


def unknown_flag(config: Any, args: list[str]) -> str | None:
    """The first flag that names no field of the config tree, as one line with the allowed keys (None: all
    name fields; ``--a.no-b`` names boolean ``a.b``). Paths into lists and choices are not followed."""
    for name in flag_names(args):
        obj, parts = config, name.split(".")
        for i, part in enumerate(parts):
            if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
                break
            fields = public_fields(obj)
            last = i == len(parts) - 1
            if part in fields:
                obj = getattr(obj, part)
            elif last and part.startswith("no_") and part[3:] in fields:
                break
            else:
                where = f"[{'.'.join(parts[:i])}]" if i else "the top level"
                return f"unknown flag '--{name}'; allowed keys in {where}: {', '.join(sorted(fields))}"
    return None


def refused_choice(config: Any, args: list[str]) -> str | None:
    """The first flag whose value is not one of its field's ``Literal`` choices, refused in the words the
    TOML loader uses (``quantize.backend = 'real': expected one of emulate, torchao, auto (...)``); tyro's own
    refusal would name the same, in other words. None: no such flag."""
    for flag in scan(args):
        *path, last = flag.name.replace("-", "_").split(".")
        parent = config
        for part in path:
            parent = getattr(parent, part, None)
        if len(flag.values) != 1 or not dataclasses.is_dataclass(parent) or isinstance(parent, type):
            continue
        tp = field_types(type(parent)).get(last)
        if tp is not None and literal_choices(tp) and flag.values[0] not in literal_choices(tp):
            try:
                coerce(flag.values[0], tp, flag.name.replace("-", "_"))
            except ConfigError as e:
                return str(e)
    return None


def tyro_message(box: str) -> str:
    """tyro's framed error as one line: the box's first paragraph (``Unrecognized options: --a.b, 4``).

    A value a section refuses (its ``ConfigError``, wrapped by tyro as ``Error parsing <section>: ...``)
    comes back as that section's own line.
    """
    lines = [ln.strip().strip("│").strip() for ln in box.splitlines()]
    seps = [i for i, ln in enumerate(lines) if ln and (set(ln) <= set("-─━") or ln[0] in "╭╰")]
    body = lines[seps[0] + 1 : seps[1]] if len(seps) > 1 else lines[(seps or [-1])[0] + 1 :]
    msg = " ".join(ln for ln in body if ln) or "tyro refused the command line"
    msg = msg.removeprefix("Error parsing ")
    name, sep, rest = msg.partition(": ")
    if sep and not name.startswith("-") and " " not in name and "=" in rest:
        return rest  # a section's own check: "profiling.x = -1: expected ..."
    return f"command line: {msg}"


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
