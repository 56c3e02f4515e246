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

from low_bits_training.cli.runner import REPO
from low_bits_training.errors import ConfigError
from low_bits_training.run.exits import ExitCode
from low_bits_training.speed import GPUS, GemmTarget, GpuSpec, Prediction, gpu, predict

AC_RECOMPUTE = {"SelectiveAC": 0.5, "FullAC": 1.0, "MemoryBudgetAC": 0.5}
"""Activation checkpointing config class -> extra forward passes of the linears (torchtitan's per-op
selective AC recomputes every second matmul)."""


def load_config(config_file: str, args: list[str]) -> tuple[object, str]:
    """The run's config as ``lbt-doctor`` builds it (``cli.config_checks.checked_config`` with ``stand_in``:
    where the preset's tokenizer is missing, as for 8B / 70B presets without their Hugging Face files, the
    built-in corpus stands in for the data).

    Returns:
        The config and a note ("" unless the tokenizer stand-in was used).

    Raises:
        ConfigError: the config does not resolve.
    """
    from low_bits_training.cli.config_checks import checked_config, cpu_adapters_once

    cpu_adapters_once()
    check, config = checked_config(config_file, args, stand_in=True)
    if config is None:
        raise ConfigError(check.detail)
    note = ""
    if check.status == "WARN":
        note = "note: tokenizer absent here; shapes read with the built-in corpus as dataset (the model is "
        note += "the base's, vocabulary included)"
    return config, note


def resolved(config, hw, quantize=None) -> tuple[dict, dict]:
    """(FQN -> LinearPlan, FQN -> LayerShape) of ``config`` resolved on ``hw``: the registry of targets
    (``titan.targets.registry``) where it exists, else ``titan.targets.linear``'s plan."""
    try:
        from low_bits_training.titan.targets.registry import resolve_run
    except ImportError:  # before the registry of targets
        from low_bits_training.titan.targets.linear import layer_shapes, plan_on

        return plan_on(config, hw, quantize), layer_shapes(config)
    run = resolve_run(config, hw, quantize)
    return run.plans, run.shapes


def _walk(node, prefix: str = ""):
    """(fqn, config) of every dataclass in the model config tree, FQNs as the built modules have them."""
    if isinstance(node, list | tuple):
        for i, v in enumerate(node):
            yield from _walk(v, f"{prefix}.{i}" if prefix else str(i))
    elif dataclasses.is_dataclass(node) and not isinstance(node, type):
        yield prefix, node
        for f in dataclasses.fields(node):
            yield from _walk(getattr(node, f.name, None), f"{prefix}.{f.name}" if prefix else f.name)


def _kind(shape) -> str:
    kind = getattr(shape, "kind", None)
    if kind in ("qk", "pv", "experts"):
        return kind
    return "experts" if shape.grouped else (shape.product or "linear")


def _moe(nodes: dict, fqn: str) -> tuple[int, int]:
    """(top_k, num_experts) of the experts module of expert weight ``fqn``."""
    owner = fqn.rsplit(".", 1)[0]
    experts = nodes[owner].num_experts
    routers = [f for f, n in nodes.items() if getattr(n, "top_k", None)]
    best = max(routers, key=lambda f: len(_common(f, owner)), default=None)
    return (nodes[best].top_k if best is not None else 1), experts


def _common(a: str, b: str) -> str:
    out = []
    for x, y in zip(a.split("."), b.split("."), strict=False):
        if x != y:
            break
        out.append(x)
    return ".".join(out)


def run_targets(config, plans: dict, shapes: dict, dp: int) -> list[GemmTarget]:
    """The speed model's targets of ``config``'s step on one GPU: every plan entry with its token count
    (experts: routed tokens x top_k), instances (attention: batch x heads) and activation recompute."""
    nodes = dict(_walk(config.model_spec.model))
    batch, seq = config.training.local_batch_size, config.training.seq_len
    recompute = AC_RECOMPUTE.get(type(config.activation_checkpoint).__qualname__.split(".")[0], 0.0)
    fp8_ag = config.quantize.torchao.enable_fsdp_float8_all_gather
    out = []
    for fqn, plan in plans.items():
        shape, kind = shapes[fqn], _kind(shapes[fqn])
        k, n = shape.in_features, max(1, shape.out_features // max(1, shape.tp))
        if kind in ("qk", "pv"):
            heads = nodes[fqn.rsplit(".", 1)[0]].n_heads
            out.append(
                GemmTarget(
                    fqn, k, n, seq, plan, kind, batch * heads, causal=0.5, recompute=float(kind == "qk")
                )
            )
        elif kind == "experts":
            top_k, experts = _moe(nodes, fqn)
            out.append(
                GemmTarget(fqn, k, n, batch * seq * top_k, plan, kind, groups=experts, recompute=recompute)
            )
        else:
            w = plan.spec("forward.weight")
            share = 1.0 / dp if fp8_ag and w is not None and w.scaling == "tensor" else 1.0
            out.append(GemmTarget(fqn, k, n, batch * seq, plan, recompute=recompute, weight_share=share))
    return out  # fmt: skip


def emulated_share(pred: Prediction, plans: dict) -> float:
    """Share of the step's quantized GEMM FLOPs (an operand in low precision) that this package would run
    emulated on that GPU (``plan.backends.gemm_backend``): slower than the model's kernels."""
    from low_bits_training.plan.backends import gemm_backend

    quantized = emulated = 0.0
    for row in pred.rows:
        plan = plans[row.target.fqn]
        for g in row.gemms:
            backend = gemm_backend(plan, g.gemm)
            if backend != "high":
                quantized += g.flops
                emulated += g.flops * (backend in ("emulate", "torchao_emulated"))
    return emulated / quantized if quantized else 0.0


def run_targets_on(config, spec: GpuSpec, recipe: str | None, dp: int) -> tuple[list[GemmTarget], dict]:
    """``config``'s targets with their plans resolved on ``spec`` (with ``recipe`` in place of its own, if
    given), and the plans (FQN -> LinearPlan). Resolution takes seconds at 8B: once per GPU and recipe."""
    quantize = dataclasses.replace(config.quantize, recipe=recipe) if recipe else None
    plans, shapes = resolved(config, spec.hardware(), quantize)
    return run_targets(config, plans, shapes, dp), plans


def predict_run(config, spec: GpuSpec, recipe: str | None, dp: int) -> tuple[Prediction, dict]:
    """The prediction of ``config``'s step on ``spec`` (with ``recipe`` in place of its own, if given)."""
    targets, plans = run_targets_on(config, spec, recipe, dp)
    return predict(targets, spec), plans


def as_run_line(targets: list[GemmTarget], plans: dict, spec: GpuSpec) -> tuple[str, float, float]:
    """What this package runs of a resolved plan on ``spec`` (lbt-speed, lbt-doctor's "speed" row, the
    launcher's note), from ``run_targets_on``.

    Returns:
        One line (the share of quantized GEMM FLOPs emulated, those in fp32, the predicted step against
        bf16's beside the kernels' figure), the predicted speedup as run, and the emulated share.
    """
    kernels, ours = predict(targets, spec), predict(targets, spec, as_run=True)
    share = emulated_share(kernels, plans)
    if not share:
        line = f"this package on {spec.name}: no quantized GEMM emulated; step {kernels.speedup:.2f}x bf16's"
        return line, kernels.speedup, 0.0
    fp32 = ours.dtype_share().get("fp32", 0.0)
    where = f", {fp32:.0%} of the GEMM FLOPs in fp32 on CUDA cores" if fp32 else ""
    line = (
        f"this package on {spec.name}: {share:.0%} of the quantized GEMM FLOPs emulated{where}: predicted "
        f"step {ours.speedup:.2f}x bf16's (the kernels' figure: {kernels.speedup:.2f}x)"
    )
    return line, ours.speedup, share


def report_run(ns, rest: list[str]) -> ExitCode:
    from low_bits_training.speed.report import layer_table, summary

    config, note = load_config(ns.config_file, rest)
    if note:
        print(note)
    recipe = ns.recipe or config.quantize.recipe
    print(
        f"{ns.config_file}: recipe {recipe}, {config.training.local_batch_size} x {config.training.seq_len} tokens a GPU"
    )
    for name in ns.gpu:
        targets, plans = run_targets_on(config, gpu(name), ns.recipe, ns.dp)
        pred = predict(targets, gpu(name))
        print("\n" + summary(pred))
        print("  " + as_run_line(targets, plans, gpu(name))[0])
        if ns.layers:
            print("\n" + layer_table(pred))
    return ExitCode.OK


def spec_for(hw) -> GpuSpec | None:
    """The speed model's GPU for ``hw`` (``nn.hardware.Hardware``): this machine's GPU when it has
    that capability, else the part that defines it (SM90: H100, SM100: B200); None on a CPU or another
    capability."""
    import torch

    from low_bits_training.speed.gpus import gpu_for_device

    if hw.kind != "cuda":
        return None
    if torch.cuda.is_available() and tuple(torch.cuda.get_device_capability(0)) == hw.capability:
        here = gpu_for_device(torch.cuda.get_device_name(0))
        if here is not None:
            return here
    return {(9, 0): GPUS["H100"], (10, 0): GPUS["B200"]}.get(hw.capability)


def check_speed(config, hw) -> list:
    """lbt-doctor's "speed" row on a GPU (none on a CPU): ``as_run_line``; a WARN where emulated GEMMs make
    the step predicted slower than bf16's."""
    from low_bits_training.cli.checks import Check

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
    from low_bits_training.nn.hardware import detect_hardware

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

    from low_bits_training.nn.recipes import RECIPES
    from low_bits_training.speed.report import table

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
    from low_bits_training.nn.recipes import recipe_specs

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
            from low_bits_training.speed.published import comparison
            from low_bits_training.speed.report import published_table

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
