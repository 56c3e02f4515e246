"""What autograd saves for the backward as a kind of plan target: ``[[quantize.saved]]`` on the built model.

The formats are resolved with the run (``resolve``, called by ``titan.targets.registry.resolve_run``: module
FQNs from the model's config tree, the block-size check against its linears' widths and the attention head
dim); ``KIND.convert`` wraps the model spec's ``parallelize_fn`` so that, once torchtitan has applied
activation checkpointing, torch.compile and FSDP2, the chosen modules get their saved-tensor hooks
(``nn.saved``). ``log_saved_bytes`` writes what the hooks stored into the metrics on logging steps, and once
what the allocator holds for the same saves (``allocator_meter``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
from torchtitan.protocols.module import Module

from low_bits_training.config.saved import SavedFormat, resolve_saved
from low_bits_training.formats import QuantSpec, group_scales, grouped_shape, in_scale_units
from low_bits_training.nn import saved as nn_saved
from low_bits_training.nn.state import clean_fqn
from low_bits_training.optim.codec import StateCodec, read_scales, store_scales
from low_bits_training.optim.memory import HeldBytes
from low_bits_training.titan.platform.compat import profiler_running
from low_bits_training.titan.targets.kind import TargetKind


def modules_of(model_config) -> list[str]:
    """Every module FQN of the model's config tree, in model order (the root is "")."""
    return [fqn for fqn, _, _, _ in model_config.traverse(Module.Config, recurse=True)]


def last_dims(model_config, shapes: dict) -> dict[str, set[int]]:
    """Module FQN -> the last dims of what it may save: the in / out features of the GEMM entries under it
    and the head dim of attention modules under it."""
    heads = {
        fqn: cfg.head_dim
        for fqn, cfg, _, _ in model_config.traverse(Module.Config, recurse=True)
        if isinstance(getattr(cfg, "head_dim", None), int)
    }
    out: dict[str, set[int]] = {}
    for m in modules_of(model_config):
        under = functools.partial(_under, m)
        dims = {d for f, s in shapes.items() if under(f) for d in (s.in_features, s.out_features)}
        dims |= {h for f, h in heads.items() if under(f)}
        out[m] = dims
    return out


def _under(module: str, fqn: str) -> bool:
    return not module or fqn == module or fqn.startswith(module + ".")


def compiled_blocks(config) -> bool:
    """torchtitan compiles each transformer block on its own (``compile.enable`` with ``model``)."""
    return bool(config.compile.enable and "model" in config.compile.components)


def resolve(config, shapes: dict, quantize=None) -> dict[str, SavedFormat]:
    """Module FQN -> format of its saves (``config.saved.resolve_saved`` on this config's model; the rules of
    ``quantize``, default ``config.quantize``).

    Raises:
        ConfigError: one line (a glob, a block inside a compiled block, a block size, a format field).
    """
    rules = (quantize or config.quantize).saved
    if not rules:
        return {}
    model = config.model_spec.model
    return resolve_saved(rules, modules_of(model), compiled_blocks(config), last_dims(model, shapes))


class SaveCodec:
    """Codes + scales of a save in ``optim.codec.StateCodec``'s vectorized layout (rows of the last dim; e8m0
    / ue4m3 scales one byte each, bf16 two; bf16 / fp16 a plain cast); the decoded values equal
    ``nn.saved.ReferenceCodec``'s (``formats.quantize``) bit for bit (tested). Tensor / axis scaling: the
    scale from ``formats.group_scales``, the elements divided by it coded as a scale-free format."""

    def __init__(self, spec: QuantSpec):
        self.spec = spec
        inner = spec if spec.scaling in ("none", "block") else dataclasses.replace(spec, scaling="none")
        self.rows = StateCodec(inner)

    def fits(self, t: torch.Tensor) -> bool:
        return self.rows.fits((t.shape[-1],)) and t.element_size() > self.rows.spec.elem.bits // 8

    def encode(self, t: torch.Tensor):
        x = t.reshape(-1, t.shape[-1]).float()
        scale = stored = None
        if self.spec.scaling in ("tensor", "axis"):
            scale = group_scales(x, self.spec, grouped_shape(x.shape, self.spec)[1]).scale
            x = in_scale_units(x, scale, self.spec)
            stored = store_scales(scale, self.spec.scale_format)  # on its grid: exact in its own width
        return self.rows.encode(x), stored, t.shape, t.dtype

    def decode(self, packed) -> torch.Tensor:
        parts, stored, shape, dtype = packed
        y = self.rows.decode(parts, (shape.numel() // shape[-1], shape[-1]))
        if stored is not None:
            y = y * read_scales(stored, self.spec.scale_format)
        return y.reshape(shape).to(dtype)

    @staticmethod
    def nbytes(packed) -> int:
        parts, scale = packed[0], packed[1]
        return sum(p.nbytes for p in parts.values()) + (scale.nbytes if scale is not None else 0)


def codec_of(fmt: SavedFormat) -> SaveCodec | None:
    """The codec a resolved format stores saves with (None: 'high', kept as made)."""
    if fmt.cast is not None:
        return SaveCodec(QuantSpec(fmt.cast, "none"))
    return SaveCodec(fmt.spec) if fmt.spec is not None else None


def stat_tails(model_config, seq_len: int, tp: int = 1) -> tuple[tuple[int, int], ...]:
    """Trailing shapes of the attention's softmax statistics, ``(local heads, seq_len)`` of every attention
    module of the model (``nn.saved.SaveFormat.keep_tails``)."""
    heads = {
        cfg.n_heads // tp
        for _, cfg, _, _ in model_config.traverse(Module.Config, recurse=True)
        if isinstance(getattr(cfg, "n_heads", None), int)
    }
    return tuple((h, seq_len) for h in sorted(heads))


def install(model, formats: dict[str, SavedFormat], keep_tails: tuple = ()) -> int:
    """Hook the modules ``formats`` names in a built (parallelized) model; returns how many were hooked."""
    n = 0
    for name, module in model.named_modules():
        fmt = formats.get(clean_fqn(name))
        if fmt is None or hasattr(module, "lbt_saved"):
            continue  # a checkpoint / compile wrapper and its wrapped module share the clean FQN: the outer one
        nn_saved.install(
            module, clean_fqn(name), nn_saved.SaveFormat(codec_of(fmt), fmt.min_numel, keep_tails)
        )
        pack_selective_saves(module)
        n += 1
    return n


def pack_selective_saves(module: torch.nn.Module) -> int:
    """Make every activation-checkpoint wrapper at or under ``module`` pass what selective AC keeps through the
    saved-tensor hooks around it (``torch.utils.checkpoint``'s ``respect_saved_tensors_hooks=True``, torch >=
    2.14); returns how many wrappers it changed.

    Without it the matmul outputs that torchtitan's per-op SAC policy keeps (eager) sit in SAC's own cache, past
    the hooks, in the precision they were made. Compiled, the block graph saves through the hooks either way.
    A wrapper is torch's ``CheckpointWrapper`` as torchtitan builds it: ``checkpoint_fn`` a partial of
    ``torch.utils.checkpoint.checkpoint`` with ``use_reentrant=False``.
    """
    import inspect

    from torch.utils.checkpoint import checkpoint

    if "respect_saved_tensors_hooks" not in inspect.signature(checkpoint).parameters:
        return 0
    n = 0
    for m in module.modules():
        fn = getattr(m, "checkpoint_fn", None)
        if (
            isinstance(fn, functools.partial)
            and fn.func is checkpoint
            and fn.keywords.get("use_reentrant") is False
        ):
            m.checkpoint_fn = functools.partial(fn, respect_saved_tensors_hooks=True)
            n += 1
    return n


def with_saved_hooks(parallelize_fn, config, formats: dict[str, SavedFormat]):
    """Wrap torchtitan's ``parallelize_fn``: once it returns, hook the saves the run resolved."""
    tp = max(1, config.parallelism.tensor_parallel_degree)
    tails = stat_tails(config.model_spec.model, config.training.seq_len, tp)

    @functools.wraps(parallelize_fn)
    def wrapped(model, *args, **kwargs):
        model = parallelize_fn(model, *args, **kwargs)
        install(model, formats, tails)
        return model

    wrapped.__lbt_saved__ = True
    return wrapped


def convert(config, run) -> None:
    """Hook the run's ``[[quantize.saved]]`` formats into the model spec (nothing without rules)."""
    spec = config.model_spec
    if run.saved and not getattr(spec.parallelize_fn, "__lbt_saved__", False):
        spec.parallelize_fn = with_saved_hooks(spec.parallelize_fn, config, run.saved)


def format_saved(formats: dict[str, SavedFormat]) -> str:
    """The plan table's lines for ``[[quantize.saved]]`` (empty without rules)."""
    if not formats:
        return ""
    width = max(len(m) for m in formats)
    rows = [f"  {m:<{width}}  {f.label}  (quantize.saved[{f.rule}])" for m, f in formats.items()]
    return (
        "\nsaved for the backward (parameters, softmax statistics, tensors < min_numel kept):\n"
        + "\n".join(rows)
        + "\n"
    )


@contextlib.contextmanager
def allocator_meter(trainer):
    """Around one attempt at a step: the step the allocator measures (the second this process runs, or its
    first when the run ends there) runs under ``optim.memory.HeldBytes``: its peak (``titan/runtime/peak.py``
    ``log_peak`` holds it beside the plan) and each hooked module's call as a span (``nn.saved.METER``;
    the spans' figures go to ``log_saved_bytes``). Nothing on other steps. On the CPU that step runs under the
    profiler's memory events (slower, once); not at all while another profiler records (torchtitan's
    ``[profiler]`` window or ``profiling.memory_timeline_step`` on that step: two cannot run at once)."""
    first = trainer.__dict__.setdefault("_lbt_saved_first", trainer.step)
    measured = trainer.step == first + 1 or trainer.step == first == trainer.config.training.steps
    trainer._lbt_saved_meter = None
    if not measured or profiler_running():
        yield
        return
    device = next(p.device for part in trainer.model_parts for p in part.parameters())
    if device.type == "cpu":
        # What torchtitan's train_step does first, done here before the count starts: the CPU allocator reports
        # to the profiler only the frees of what it made while the profiler ran, so the last step's gradients,
        # dropped there, would be counted as held through this step's peak.
        trainer.optimizers.zero_grad(set_to_none=trainer.config.training.disable_cuda_graphs)
    meter = HeldBytes(device, exclude=("FSDP::",))
    nn_saved.METER = meter
    try:
        with meter.recording():
            yield
    finally:
        nn_saved.METER = None
    trainer._lbt_saved_meter = meter


def log_saved_bytes(trainer) -> dict | None:
    """This step's saved bytes per token on this rank (None without ``[[quantize.saved]]``): ``stored`` and
    ``as_made`` by the hooks, and on the step ``allocator_meter`` measured, ``allocator`` (what the hooked
    modules' calls left allocated, less their outputs) and ``modules`` (each module's three figures).
    Written into the metrics on logging steps (``saved/allocator_bytes_per_token`` on the measured step)."""
    got = nn_saved.take_bytes()
    if not got:
        return None
    made = sum(v[1] for v in got.values())
    kept = sum(v[2] for v in got.values())
    cfg = trainer.config.training
    tokens = cfg.local_batch_size * cfg.seq_len * getattr(trainer, "gradient_accumulation_steps", 1)
    per_token = {"stored": kept / tokens, "as_made": made / tokens}
    metrics = {
        "saved/bytes": kept,
        "saved/bytes_hp": made,
        "saved/ratio": kept / made if made else 1.0,
        "saved/bytes_per_token": per_token["stored"],
    }
    meter = getattr(trainer, "_lbt_saved_meter", None)
    if meter is not None:
        held = meter.held()
        per_token["allocator"] = sum(held.values()) / tokens
        per_token["modules"] = {
            m: {"stored": v[2] / tokens, "as_made": v[1] / tokens, "allocator": held.get(m, 0) / tokens}
            for m, v in got.items()
        }
        metrics["saved/allocator_bytes_per_token"] = per_token["allocator"]
    if trainer.metrics_processor.should_log(trainer.step) or meter is not None:
        trainer.metrics_processor.logger.log(metrics, trainer.step)
    return per_token


KIND = TargetKind(
    name="saved",
    what="a module's saved activations",
    switchable=False,
    convert=convert,
)
"""What autograd keeps for the backward as a kind of plan target (``titan.targets.registry``): no GEMM entries;
its convert hooks the model spec's parallelize function."""
