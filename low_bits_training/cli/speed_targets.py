"""A run's config read by the speed model (``lbt-speed``, lbt-doctor's "speed" row, the launcher's note): the
config loaded as lbt-doctor loads it, its plan resolved on a GPU, its GEMM targets (tokens, instances,
experts, activation recompute), their prediction and the line saying what this package runs of it."""

from __future__ import annotations

import dataclasses

from low_bits_training.cli.config_checks import checked_config
from low_bits_training.errors import ConfigError
from low_bits_training.plan.backends import gemm_backend
from low_bits_training.speed import GemmTarget, GpuSpec, Prediction, predict
from low_bits_training.titan.targets.registry import resolve_run

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
    # the speed model plans for GPUs elsewhere: no peak-memory plan against this machine (titan/launch/memory.py)
    check, config = checked_config(config_file, [*args, "--memory.no-plan"], stand_in=True)
    if config is None:
        raise ConfigError(check.detail)
    note = ""
    if check.status == "WARN":
        note = "note: tokenizer absent here; shapes read with the built-in corpus as dataset (the model is "
        note += "the base's, vocabulary included)"
    return config, note


def resolved(config, hw, quantize=None) -> tuple[dict, dict]:
    """(FQN -> LinearPlan, FQN -> LayerShape) of ``config`` resolved on ``hw`` (``titan.targets.registry``)."""
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
