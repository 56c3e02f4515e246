"""Checks that need the run's config: does it resolve, can its formats run here, are its data and tokenizer
reachable, is there disk for its checkpoints."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from low_bits_training.cli.checks import Check, check_disk

# Smallest compute capability with real kernels, per family of recipe names (first match wins). Data, not
# branches: a new family is one more row.
# ``on_cpu``: a real low-bit GEMM exists on the CPU (torch._scaled_mm runs fp8 there, slowly).
FORMAT_HARDWARE: tuple[tuple[str, tuple[int, int], str, bool], ...] = (
    ("nvfp4", (10, 0), "NVFP4 real kernels need SM100 (B200)", False),
    ("mx", (10, 0), "MX real kernels need SM100 (B200)", False),
    ("fp8", (8, 9), "fp8 kernels need SM89+ (L4/H100)", True),
)
FULL_PRECISION = ("", "none", "fp32", "bf16", "float32", "bfloat16")
HUB_FREE_DATASETS = ("lbt_markov", "lbt_markov_validation")
_TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")


def recipes_in(data: dict[str, Any], args: list[str]) -> list[str]:
    """Recipe names a run uses: ``[quantize] recipe`` in the TOML, overridden by ``--quantize.recipe X``."""
    recipe = data.get("quantize", {}).get("recipe")
    for i, a in enumerate(args):
        if a.startswith("--quantize.recipe="):
            recipe = a.split("=", 1)[1]
        elif a == "--quantize.recipe" and i + 1 < len(args):
            recipe = args[i + 1]
    return [recipe] if recipe else []


def check_format(recipe: str, capability: tuple[int, int] | None, emulate: bool | None = None) -> Check:
    """Whether ``recipe`` runs with real kernels on this hardware or needs emulation.

    Args:
        recipe: a recipe name (``fp8_rowwise``, ``mxfp8``, ``nvfp4`` ...).
        capability: the GPU's (major, minor), or None without a GPU.
        emulate: the config's ``quantize.emulate`` if it has one.

    Returns:
        OK (real kernels, fp8 on CPU, or full precision), WARN (emulated), FAIL (needs emulation but ``emulate = false``).
    """
    name = f"format {recipe}"
    if recipe.lower() in FULL_PRECISION:
        return Check(name, "OK", "no quantization")
    row = next((r for r in FORMAT_HARDWARE if r[0] in recipe.lower()), None)
    if row is None:
        return Check(
            name, "WARN", "unknown recipe family: hardware support not known", "check the recipe name"
        )
    _, need, why, on_cpu = row
    if capability is not None and capability >= need:
        return Check(name, "OK", f"real kernels (SM{capability[0]}{capability[1]})")
    if capability is None and on_cpu:
        return Check(name, "OK", "CPU: real fp8 GEMM via torch._scaled_mm (slow), or emulation")
    where = "CPU" if capability is None else f"SM{capability[0]}{capability[1]}"
    if emulate is False:
        return Check(name, "FAIL", f"{where}: {why}", "set quantize.emulate = true or run on newer GPUs")
    return Check(
        name, "WARN", f"emulated on {where}: {why}", "numerics are exact; speed is not representative"
    )


def gpu_capability() -> tuple[int, int] | None:
    """The first GPU's compute capability, or None without a GPU."""
    import torch

    return tuple(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None


def cpu_adapters_once() -> None:
    """The CPU adapters before the first torchtitan import (a no-op when they are in or not needed)."""
    import sys

    from low_bits_training.titan import cpu

    tt = sys.modules.get("torchtitan.tools.utils")
    if cpu.needs_cpu_adapters() and getattr(tt, "device_type", None) != "cpu":
        cpu.install_device_module()


def load(config_file: str | None, args: list[str]) -> tuple[Check, Any]:
    """Resolve the config (base < TOML < args) as the launcher does; a ConfigError is a FAIL.

    Returns:
        The check and the config (None when it did not resolve).
    """
    from low_bits_training.config.tree import ConfigError
    from low_bits_training.titan.configure import load_config

    try:
        config = load_config(config_file, args)
    except ConfigError as e:
        return Check("config", "FAIL", str(e), "fix the key named above"), None
    except SystemExit:  # tyro rejected a flag (it printed why)
        return Check("config", "FAIL", f"bad command-line override in {args}", "see the message above"), None
    return Check(
        "config", "OK", f"{config_file or 'base'} -> {config.job.base}, dump_folder {config.dump_folder}"
    ), config


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
    """The tokenizer folder (``hf_assets_path``) has a tokenizer file; the Markov corpus brings its own."""
    path = Path(config.hf_assets_path)
    found = [f for f in _TOKENIZER_FILES if (path / f).is_file()]
    if found:
        return Check("tokenizer", "OK", f"{path / found[0]}")
    if config.dataloader.dataset in HUB_FREE_DATASETS:
        return Check("tokenizer", "OK", "comes with the Markov corpus (built on first run)")
    return Check(
        "tokenizer",
        "FAIL",
        f"hf_assets_path = {str(path)!r}: none of {', '.join(_TOKENIZER_FILES)}",
        "download the model's tokenizer there (needs network) or fix hf_assets_path",
    )


def param_count(config: Any) -> int | None:
    """Parameters of the configured model, built on the meta device (no memory); None if that fails."""
    import torch

    try:
        with torch.device("meta"):
            model = config.model_spec.model.build()
        return sum(p.numel() for p in model.parameters())
    except Exception:  # any model we cannot build cheaply: fall back to a threshold
        return None


def checkpoint_bytes(config: Any, params: int | None) -> int | None:
    """Disk for the kept checkpoints: fp32 weights + two AdamW states (12 bytes/param) per checkpoint."""
    if params is None:
        return None
    ck = config.checkpoint
    count = config.training.steps // max(ck.interval, 1) + 1
    if ck.keep_latest_k > 0:
        count = min(count, ck.keep_latest_k)
    return 12 * params * max(count, 1)


def check_checkpoint_disk(config: Any) -> Check:
    """Free space where checkpoints go against what the kept checkpoints need."""
    if not config.checkpoint.enable:
        return Check("disk", "OK", "checkpointing off (a killed run cannot resume)")
    folder = Path(config.dump_folder) / config.checkpoint.folder
    return check_disk(folder, checkpoint_bytes(config, param_count(config)))


def config_checks(
    config_file: str | None, args: list[str], env: dict[str, str], extra_recipes: list[str]
) -> tuple[list[Check], bool]:
    """All checks that need the config.

    Returns:
        The checks and whether the config asks for W&B.
    """
    cpu_adapters_once()
    from low_bits_training.titan.configure import read_toml

    checks, data = [], {}
    if config_file:
        try:
            data = read_toml(config_file)
        except Exception as e:  # ConfigError: one line already
            return [Check("config", "FAIL", str(e), "fix --config-file")], False
    emulate = data.get("quantize", {}).get("emulate")
    cap = gpu_capability()
    for recipe in dict.fromkeys(recipes_in(data, args) + extra_recipes):
        checks.append(check_format(recipe, cap, emulate))
    status, config = load(config_file, args)
    checks.insert(0, status)
    if config is None:
        return checks, False
    checks += [check_tokenizer(config), check_dataset(config, env), check_checkpoint_disk(config)]
    return checks, bool(config.metrics.enable_wandb)
