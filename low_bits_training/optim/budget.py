"""Bytes of training state per parameter, from the optimizer config and the parameter shapes alone.

What a run holds for every parameter between steps (issue 27, "a byte budget for every run"):

- ``params``: the parameter in its dtype. It is also the master copy: ``master_weights`` rounds the values
  onto its grid in this same storage (fp32 params: the grid is emulated, the bytes are fp32's).
- ``grads``: the gradient, in the parameter's dtype.
- each optimizer state in its format: a native dtype (fp32 / bf16 / fp16), or uint8 codes (two 4-bit codes a
  byte) plus one scale per block (fp32 / bf16, or e8m0 / ue4m3 bytes): ``int8_block128`` is 1 + 4/128 bytes.
  The layout is the optimizer's own (``StateCodec.part_shapes`` / ``dtypes``, ``layout.fitted_codec``: norm
  weights and parameters under ``min_quantized_numel`` keep fp32 states), not a second copy of it.
- ``master_comp``: Kahan master weights' bf16 compensation buffer; ``step``: a 4-byte counter per parameter
  tensor per rank.

Bytes are summed over every rank that holds a shard (FSDP2 shards a parameter's rows over ``shards`` ranks,
its sharded params and grads padded to a multiple of ``shards`` rows; ``replicas`` copies of each). Bytes per
parameter divide by the model's parameter count. ``titan.runtime.budget`` measures the same figures on the
live tensors of a run (``optim.live_bytes``; tests/titan/runtime/test_budget_train.py holds the two equal).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .codec import StateCodec
from .layout import fitted_codec
from .options import AdamWOptions, SGDOptions

STATES = (
    "params",
    "grads",
    "exp_avg",
    "exp_avg_sq",
    "max_exp_avg_sq",
    "momentum_buffer",
    "master_comp",
    "step",
)
"""Every state a budget names, in table order (an optimizer holds a subset)."""
STEP_BYTES = 4
"""A step counter: an fp32 scalar per parameter tensor per rank (torch's, ours and torchao's optimizers)."""


@dataclass(frozen=True)
class Sharding:
    """How the parameters are held across ranks."""

    shards: int = 1
    """Ranks a parameter's rows are sharded over (FSDP2 ``Shard(0)``: the data-parallel shard degree)."""
    replicas: int = 1
    """Copies of every shard (data-parallel replicate degree)."""
    param_dtype: torch.dtype = torch.float32
    """Stored dtype of parameters and gradients (torchtitan's ``training.dtype``; FSDP2's bf16
    ``mixed_precision_param`` copy lives only while a layer computes, so it is not state)."""
    moment_dtype: torch.dtype | None = None
    """torch Adam / AdamW moments' dtype (None: the parameter's; torchtitan's ``fused_opt_states_bf16``:
    bf16)."""

    def rows(self, d0: int) -> list[int]:
        """Rows of a dim-0 of ``d0`` on each shard (``torch.chunk``'s split, as FSDP2's)."""
        per = -(-d0 // self.shards)
        return [max(0, min(per, d0 - i * per)) for i in range(self.shards)]

    def local_shapes(self, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
        """The local shape on each shard (one shape per shard; a 0-d parameter is not sharded)."""
        if not shape or self.shards == 1:
            return [tuple(shape)] * self.shards
        return [(r, *shape[1:]) for r in self.rows(shape[0])]

    def padded_numel(self, shape: tuple[int, ...]) -> int:
        """Elements of FSDP2's sharded storage over all shards: rows padded to a multiple of ``shards``."""
        if not shape or self.shards == 1:
            return math.prod(shape) * self.shards
        return self.shards * -(-shape[0] // self.shards) * math.prod(shape[1:])


@dataclass
class StateBytes:
    """Bytes of each state over all ranks, and the model's parameter count."""

    numel: int = 0
    """Parameters of the model (each counted once)."""
    nbytes: dict[str, int] = field(default_factory=dict)
    """State -> bytes summed over every rank."""
    formats: dict[str, list[str]] = field(default_factory=dict)
    """State -> the formats it is held in (several where some parameters fall back to fp32)."""

    def add(self, state: str, nbytes: int, fmt: str) -> None:
        self.nbytes[state] = self.nbytes.get(state, 0) + nbytes
        held = self.formats.setdefault(state, [])
        if fmt not in held:
            held.append(fmt)

    def per_param(self) -> dict[str, float]:
        """State -> bytes per parameter, in ``STATES`` order, and ``total``."""
        out = {s: self.nbytes[s] / self.numel for s in STATES if s in self.nbytes}
        out["total"] = sum(self.nbytes.values()) / self.numel
        return out


def dtype_name(dtype: torch.dtype) -> str:
    """``fp32`` / ``bf16`` / ``fp16`` / ``uint8`` ..., the names the formats use."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(
        dtype, str(dtype).removeprefix("torch.")
    )


def codec_bytes(codec: StateCodec, shape: tuple[int, ...]) -> int:
    """Bytes of one state of a shard of ``shape`` stored by ``codec`` (codes and scales)."""
    sizes = codec.part_shapes(shape)
    return sum(math.prod(sizes[s]) * dt.itemsize for s, dt in codec.dtypes().items())


def codec_label(codec: StateCodec) -> str:
    """``int8 codes + fp32 scale/128`` (``int8_block128``), ``e2m1 codes (2 a byte) + e8m0 scale/32``, or a
    native format's name (``fp32``)."""
    spec = codec.spec
    if codec.native:
        return spec.format
    codes = f"{spec.format} codes{' (2 a byte)' if codec.per_byte == 2 else ''}"
    scales = f" + {spec.scale_format} scale/{spec.block_size}" if spec.scaling == "block" else ""
    return f"{codes}{scales}"


StateModel = Callable[[dict[str, Any], tuple[int, ...], list[tuple[int, ...]], Sharding, StateBytes], None]
"""(param group, global shape, local shape of each shard, sharding, budget to add to) -> None."""


def _torch_adam(group, shape, locals_, sh, out) -> None:
    dtype = sh.moment_dtype or sh.param_dtype
    names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group.get("amsgrad") else ("exp_avg", "exp_avg_sq")
    for name in names:
        out.add(name, sum(math.prod(s) for s in locals_) * dtype.itemsize * sh.replicas, dtype_name(dtype))


OPTIONS = {"LowBitAdamW": AdamWOptions, "LowBitSGD": SGDOptions}
"""Our optimizers' option classes (their state formats and master-weight format)."""


def _lowbit(opts_cls) -> StateModel:
    def model(group, shape, locals_, sh, out) -> None:
        opts = opts_cls.from_group(group)
        for name, spec in opts.state_specs().items():
            for lshape in locals_:
                codec = fitted_codec(spec, shape, lshape, opts.min_quantized_numel)
                out.add(name, codec_bytes(codec, lshape) * sh.replicas, codec_label(codec))
        if opts.master_rounding == "kahan":
            comp = sum(math.prod(s) for s in locals_) * torch.bfloat16.itemsize * sh.replicas
            out.add("master_comp", comp, "bf16")

    return model


@dataclass(frozen=True)
class TorchaoState:
    """torchao.optim's state layout (``_new_buffer``): flat codes, an fp32 scale per block, a lookup table."""

    bits: int
    block: int
    qmap: int
    """fp32 entries of the per-tensor code table (0: none)."""
    label: str

    def __call__(self, group, shape, locals_, sh, out) -> None:
        names = (
            ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group.get("amsgrad") else ("exp_avg", "exp_avg_sq")
        )
        for name in names:
            for lshape in locals_:
                n = math.prod(lshape)
                if n >= 4096 and n % self.block == 0:  # torchao quantizes these (bitsandbytes' rule)
                    b, fmt = n * self.bits // 8 + n // self.block * 4 + self.qmap * 4, self.label
                else:  # zeros_like the parameter
                    b, fmt = n * sh.param_dtype.itemsize, dtype_name(sh.param_dtype)
                out.add(name, b * sh.replicas, fmt)


STATE_MODELS: dict[str, StateModel] = {
    "Adam": _torch_adam,
    "AdamW": _torch_adam,
    **{name: _lowbit(cls) for name, cls in OPTIONS.items()},
    "AdamW8bit": TorchaoState(8, 256, 256, "torchao 8-bit codes + fp32 scale/256 + 256-entry table"),
    "AdamW4bit": TorchaoState(4, 128, 16, "torchao 4-bit codes (2 a byte) + fp32 scale/128 + 16-entry table"),
    "AdamWFp8": TorchaoState(8, 256, 0, "torchao e4m3 codes + fp32 scale/256"),
}
"""Optimizer name (``optimizer_name``) -> how it lays out its states."""


def master_label(group: dict[str, Any], optimizer: str, param_dtype: torch.dtype) -> str:
    """The params row's format: its dtype, and the master-weight grid its values sit on (ours)."""
    own = dtype_name(param_dtype)
    opts = OPTIONS[optimizer].from_group(group) if optimizer in OPTIONS else None
    spec = opts and opts.master_spec
    if spec is None:
        return own
    grid = spec.format if spec.scaling == "none" else codec_label(StateCodec(spec))
    return f"{own} on a {grid} grid ({opts.master_rounding})"


def state_bytes(
    params: Iterable[tuple[str, tuple[int, ...], str, dict[str, Any]]], sharding: Sharding = Sharding()
) -> StateBytes:
    """The bytes of every training state, from parameter shapes and their optimizer groups.

    Args:
        params: (FQN, global shape, optimizer name, its param group dict: the ``optimizer_kwargs`` plus
            torchtitan's ``fused`` / ``foreach``) of each parameter the optimizers update.
        sharding: ranks, padding and dtypes (``Sharding``).

    Returns:
        Bytes of each state over all ranks, with the parameter count.

    Raises:
        ValueError: an optimizer whose state layout is not known here (``STATE_MODELS``), or bad kwargs.
    """
    out = StateBytes()
    pdt = sharding.param_dtype
    copies = sharding.replicas
    for _fqn, shape, name, group in params:
        if name not in STATE_MODELS:
            raise ValueError(f"no byte model for optimizer {name!r}; known: {', '.join(STATE_MODELS)}")
        shape = tuple(shape)
        out.numel += math.prod(shape)
        stored = sharding.padded_numel(shape) * pdt.itemsize * copies
        out.add("params", stored, master_label(group, name, pdt))
        if group.get("in_backward"):  # used and freed in the backward, one parameter's at a time
            out.add("grads", 0, f"{dtype_name(pdt)}, freed in the backward")
        else:
            out.add("grads", stored, dtype_name(pdt))
        STATE_MODELS[name](group, shape, sharding.local_shapes(shape), sharding, out)
        out.add("step", STEP_BYTES * sharding.shards * copies, "fp32 scalar per tensor")
    return out


def format_budget(plan: StateBytes, measured: StateBytes | None = None) -> str:
    """An aligned text table: state, format(s), bytes per parameter computed (and measured), total last.

    Args:
        plan: the computed budget (``state_bytes``).
        measured: the same run's live bytes (``live_bytes`` summed over ranks), or None.
    """
    head = ["state", "format", "B/param"] + (["measured"] if measured else [])
    rows, got = [head], measured.per_param() if measured else {}
    for state, value in plan.per_param().items():
        fmt = "; ".join(plan.formats.get(state, []))
        rows.append([state, fmt, f"{value:.3f}"] + ([f"{got.get(state, 0.0):.3f}"] if measured else []))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + f"\n({plan.numel:,} parameters)\n"
