"""``lbt-speed``: what a run's precision plan buys on a GPU, from the speed model (docs/speed_model.md).

    lbt-speed --config-file train_configs/llama3_8b.toml --recipe mxfp8 --gpu B200 [--layers]
    lbt-speed --published                          # the model against published speedups
    lbt-speed --presets --gpu H100 --gpu B200      # every preset x every recipe

The run config is loaded as ``lbt-doctor`` loads it (TOML, overrides, the launcher's checks) and its plan is
resolved as on the named GPU (SM90 for H100 / H200, SM100 for the Blackwell parts), so each layer's backend
is the one that GPU would get. Bad input: one line ``lbt-speed: config error: ...`` and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from low_bits_training.cli.checks import Check
from low_bits_training.cli.runner import REPO
from low_bits_training.cli.speed_targets import (
    as_run_line,
    load_config,
    resolved,
    run_targets,
    run_targets_on,
)
from low_bits_training.errors import ConfigError
from low_bits_training.nn.hardware import detect_hardware
from low_bits_training.nn.recipes import RECIPES, recipe_specs
from low_bits_training.run.exits import ExitCode
from low_bits_training.speed import GPUS, GemmTarget, GpuSpec, gpu, predict
from low_bits_training.speed.gpus import gpu_for_device
from low_bits_training.speed.published import comparison
from low_bits_training.speed.report import layer_table, published_table, summary, table
from low_bits_training.titan.launch.memory import check_peak


def report_run(ns, rest: list[str]) -> ExitCode:
    config, note = load_config(
        ns.config_file, [*rest, *(["--quantize.recipe", ns.recipe] if ns.recipe else [])]
    )
    if note:
        print(note)
    recipe = ns.recipe or config.quantize.recipe
    print(
        f"{ns.config_file}: recipe {recipe}, {config.training.local_batch_size} x {config.training.seq_len} tokens a GPU"
    )
    print(f"peak memory a rank, on {ns.dp} ranks: {planned_peak(config, ns.dp)}")
    for name in ns.gpu:
        targets, plans = run_targets_on(config, gpu(name), ns.recipe, ns.dp)
        pred = predict(targets, gpu(name))
        print("\n" + summary(pred))
        print("  " + as_run_line(targets, plans, gpu(name))[0])
        if ns.layers:
            print("\n" + layer_table(pred))
    return ExitCode.OK


def planned_peak(config, ranks: int) -> str:
    """The launcher's plan of rank 0's peak (``titan/launch/memory.py``) for ``config`` on ``ranks`` ranks, as
    for GPUs elsewhere (CUDA's 512-byte blocks where ``memory.limit_gib`` is set, held to it, said and never
    refused): one line."""
    config.memory = dataclasses.replace(
        config.memory, plan=True
    )  # load_config turns the launcher's check off
    return check_peak(config, ranks, here=False, refuse=False).line()


def spec_for(hw) -> GpuSpec | None:
    """The speed model's GPU for ``hw`` (``nn.hardware.Hardware``): the GPU it names (``lbt-doctor --hardware
    h200``), else this machine's GPU when it has that capability, else the part that defines it (SM90: H100,
    SM100: B200); None on a CPU or another capability."""
    import torch

    if hw.kind != "cuda":
        return None
    if hw.gpu is not None:
        return GPUS[hw.gpu]
    if torch.cuda.is_available() and tuple(torch.cuda.get_device_capability(0)) == hw.capability:
        here = gpu_for_device(torch.cuda.get_device_name(0))
        if here is not None:
            return here
    return {(9, 0): GPUS["H100"], (10, 0): GPUS["B200"]}.get(hw.capability)


def check_speed(config, hw) -> list:
    """lbt-doctor's "speed" row on a GPU (none on a CPU): ``as_run_line``; a WARN where emulated GEMMs make
    the step predicted slower than bf16's."""
    spec = spec_for(hw)
    if spec is None:
        return []
    line, speedup, emulated = as_run_line(*run_targets_on(config, spec, None, 1), spec)
    if speedup >= 1.0 or not emulated:
        return [Check("speed", "OK", line)]
    fix = "lbt-speed --layers shows which GEMMs; a recipe this GPU has kernels for runs faster"
    return [Check("speed", "WARN", line, fix)]


def run_notes(config) -> list[str]:
    """The launcher's line before a run on this machine's GPU (``cli/train.py``): ``as_run_line`` where
    some quantized GEMM is emulated there; nothing on a CPU or where every one runs on a kernel."""
    spec = spec_for(detect_hardware())
    if spec is None:
        return []
    line, _, emulated = as_run_line(*run_targets_on(config, spec, None, 1), spec)
    return [f"{line}; lbt-speed --layers names the GEMMs"] if emulated else []


def _preset_targets(config, recipe: str | None, dp: int, cache: dict) -> list[GemmTarget]:
    """``run_targets`` of ``config`` with ``recipe``, resolved once per distinct (model, plan, training)
    among the presets (resolution takes seconds at 8B; the specs do not depend on the GPU, so SM100's)."""
    quantize = dataclasses.replace(config.quantize, recipe=recipe) if recipe else config.quantize
    parts = (
        config.model_spec.model,
        quantize,
        config.training,
        config.parallelism,
        config.activation_checkpoint,
    )
    key = "|".join(map(repr, parts))
    if key not in cache:
        plans, shapes = resolved(config, GPUS["B200"].hardware(), quantize)
        cache[key] = run_targets(config, plans, shapes, dp)
    return cache[key]


def preset_tables(gpus: list[str], dp: int) -> str:
    """One markdown table per GPU: every preset in train_configs/ (rows) x its own plan and every recipe in
    place of its ``[quantize] recipe`` (its rules and skip kept): the predicted step speedup over bf16."""
    import os

    os.chdir(REPO)  # presets name their data and assets relative to the repository
    rows: dict[str, list[list[str]]] = {name: [] for name in gpus}
    cache, misses = {}, []
    for path in sorted(p.relative_to(REPO) for p in (REPO / "train_configs").rglob("*.toml")):
        config = load_config(str(path), [])[0]
        cells: dict[str, list[str]] = {name: [str(path)] for name in gpus}
        for recipe in [None, *RECIPES]:
            try:
                targets = _preset_targets(config, recipe, dp, cache)
            except ConfigError as e:
                misses.append(f"- {path} {recipe or '(as set)'}: {e}")
                targets = None
            for name in gpus:
                cells[name].append(f"{predict(targets, gpu(name)).speedup:.2f}" if targets else "n/a")
        for name in gpus:
            rows[name].append(cells[name])
    parts = [f"{name}:\n\n" + table(["preset", "as set", *RECIPES], rows[name]) for name in gpus]
    if misses:
        parts.append("\n".join(["n/a (the plan does not resolve):", *misses]))
    return "\n\n".join(parts)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="lbt-speed", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--config-file", default="train_configs/debug_model.toml", help="the run's TOML")
    p.add_argument(
        "--recipe", default=None, help="judge this recipe instead of the config's [quantize] recipe"
    )
    p.add_argument(
        "--gpu", action="append", default=None, help=f"one of {', '.join(GPUS)} (repeatable; default B200)"
    )
    p.add_argument("--dp", type=int, default=8, help="FSDP ranks casting fp8 weights before the all-gather")
    p.add_argument("--layers", action="store_true", help="also a table per layer name")
    p.add_argument("--published", action="store_true", help="the model against published speedups")
    p.add_argument("--presets", action="store_true", help="every preset in train_configs/ x every recipe")
    ns, rest = p.parse_known_args(argv)
    ns.gpu = ns.gpu or ["B200"]
    return ns, rest


def check_args(ns: argparse.Namespace) -> None:
    """Raises ConfigError (one line) for a GPU, recipe or --dp the model does not know."""
    for name in ns.gpu:
        if name.lower() not in {g.lower() for g in GPUS}:
            raise ConfigError(f"--gpu = {name!r}: expected one of {', '.join(GPUS)}")
    if ns.recipe is not None:
        recipe_specs(ns.recipe, "--recipe")
    if ns.dp < 1:
        raise ConfigError(f"--dp = {ns.dp}: expected an int >= 1")


def main(argv: list[str] | None = None) -> ExitCode:
    ns, rest = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_args(ns)
        if ns.published:
            print(published_table(comparison()))
            return ExitCode.OK
        if ns.presets:
            print(preset_tables(ns.gpu, ns.dp))
            return ExitCode.OK
        return report_run(ns, rest)
    except ConfigError as e:
        print(f"lbt-speed: config error: {e}", file=sys.stderr)
        return ExitCode.CONFIG


if __name__ == "__main__":
    sys.exit(main())
