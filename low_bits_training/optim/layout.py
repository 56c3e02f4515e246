"""Per-parameter state layout, built once when a parameter's state is created.

A ``ParamLayout`` fixes everything the update of one parameter shard needs that does not change from step to
step: the codec of each state (its format if the shard fits it, else fp32), the master-weight format fitted
to the shard, and the chunking. The update runs over row chunks of the flattened shard viewed as
(rows, group): ``group`` is a multiple of every block (blocks never cross rows of the parameter, so the flat
shard is a run of whole blocks), or the parameter's row length when master weights are scaled per row.
Chunks hold about ``chunk_numel`` elements, so the temporaries of a step are O(chunk) whatever the
parameter's size. ``KernelSpec`` is the hashable part the chunk update is specialised (and compiled) on.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from low_bits_training.formats import QuantSpec

from .codec import StateCodec
from .dist import global_offset, local, shards_like
from .master import master_spec
from .presets import PRESETS

FP32 = StateCodec(PRESETS["fp32"])


@dataclass(frozen=True)
class KernelSpec:
    """What a chunk update is specialised on; equal specs share one compiled kernel."""

    kind: str
    """"adamw" or "sgd"."""
    states: tuple[tuple[str, StateCodec], ...]
    """(state name, codec) in the order their parts are passed."""
    master: QuantSpec | None
    """Master-weight format fitted to the shard, or None (a plain copy into the parameter)."""
    master_rounding: str
    """"nearest", "stochastic" or "kahan" (a bf16 compensation tensor follows the state parts)."""
    purposes: tuple[str, ...]
    """Uses that draw random bits, in the order of the key tensor's columns."""
    flags: tuple[str, ...] = ()
    """Optimizer switches that change the code: "sqrt_v", "v_floor" (AdamW), "nesterov", "decay" (SGD)."""

    @functools.cached_property
    def fingerprint(self) -> int:
        """The spec's hash, computed once: the fused step looks its spec up on every call, and hashing the
        nested codec specs took ~6 us on CPU (0.3 cached)."""
        return hash((self.kind, self.states, self.master, self.master_rounding, self.purposes, self.flags))

    def __hash__(self) -> int:
        return self.fingerprint

    def codec(self, name: str) -> StateCodec:
        return dict(self.states)[name]

    def key(self, keys: torch.Tensor | None, purpose: str) -> torch.Tensor | None:
        """The key tensor of ``purpose`` from a chunk's keys (None if it draws no random bits)."""
        return keys[self.purposes.index(purpose)] if purpose in self.purposes else None


def fitted_codec(
    spec: QuantSpec, shape: tuple[int, ...], local_shape: tuple[int, ...], min_numel: int
) -> StateCodec:
    """The codec of a state of a parameter of ``shape`` whose shard here is ``local_shape``, from shapes alone:
    ``spec`` if both fit its layout, else fp32 (norms, biases, parameters under ``min_numel`` elements).
    ``optim.budget`` counts bytes with it; ``state_codec`` adds the check that only a live DTensor can make."""
    c = StateCodec(spec)
    if c.native:
        return c
    if math.prod(shape) < min_numel or len(shape) < 2 or not (c.fits(shape) and c.fits(local_shape)):
        return FP32
    return c


def state_codec(p: torch.Tensor, spec: QuantSpec, min_numel: int) -> StateCodec:
    """The codec of a state of ``p``: ``spec`` if every shard fits its layout, else fp32 (norms, biases)."""
    shape, lshape = tuple(p.shape), tuple(local(p).shape)
    c = fitted_codec(spec, shape, lshape, min_numel)
    if c.native:
        return c
    glob, loc = c.part_shapes(shape), c.part_shapes(lshape)
    return c if all(shards_like(p, glob[k], loc[k]) for k in glob) else FP32


def _group(shape: tuple[int, ...], codecs: list[StateCodec], master: QuantSpec | None) -> int:
    g = math.lcm(1, *(c.group for c in codecs))
    if master is not None and master.scaling == "block":
        g = math.lcm(g, master.block_size)
    if master is not None and master.scaling == "axis":
        g = shape[-1]  # one scale per row: a row is the group (every state block divides it)
    return g


@dataclass
class ParamLayout:
    """How one parameter shard is updated: its ``KernelSpec`` and its chunks of rows of (rows, group)."""

    spec: KernelSpec
    rows: int
    group: int
    chunks: list[tuple[int, int]]
    """(first row, end row) of each chunk."""
    offset: tuple[int, ...]
    """Global index of the shard's first element (keys the random streams)."""

    def merged(self, n: int) -> list[tuple[int, int]]:
        """(first row, end row) of runs of ``n`` consecutive chunks (the last run may hold fewer)."""
        last = len(self.chunks) - 1
        return [(self.chunks[i][0], self.chunks[min(i + n - 1, last)][1]) for i in range(0, last + 1, n)]

    @property
    def starts(self) -> list[int]:
        """First element of each chunk in the flat shard."""
        return [r0 * self.group for r0, _ in self.chunks]

    def tensors(self, p: torch.Tensor, state: dict) -> list[torch.Tensor]:
        """(rows, ...) views of the parameter, its gradient and every stored part, in kernel order.

        Raises:
            ValueError: the parameter's local shard is not contiguous (its rows cannot be viewed in place).
        """
        w = local(p)
        if not w.is_contiguous():
            raise ValueError(
                f"a low-bit optimizer needs contiguous parameter shards; got strides {w.stride()}"
            )
        rows = self.rows
        return [
            w.view(rows, -1),
            local(p.grad).reshape(rows, -1),
            *(local(state[k]).view(rows, -1) for k in self.parts),
        ]

    @functools.cached_property
    def parts(self) -> tuple[str, ...]:
        """The state keys of the stored parts, in kernel order (the compensation last, with Kahan)."""
        keys = tuple(name + s for name, codec in self.spec.states for s in codec.dtypes())
        return keys + ("master_comp",) * (self.spec.master_rounding == "kahan")


def build_layout(p: torch.Tensor, opts, kind: str, flags: Callable, chunk_numel: int) -> ParamLayout:
    """The layout of ``p`` under validated group options ``opts`` (``AdamWOptions`` / ``SGDOptions``).

    Args:
        p: the parameter (a DTensor under FSDP2 / TP).
        opts: the group's options.
        kind: "adamw" or "sgd".
        flags: state codecs (name -> codec) -> the optimizer's code switches (``KernelSpec.flags``).
        chunk_numel: about how many elements one chunk holds.

    Returns:
        The layout (chunks cover every row of the local shard; a 0-d parameter is one row of one element).
    """
    lshape = tuple(local(p).shape)
    states = tuple((n, state_codec(p, s, opts.min_quantized_numel)) for n, s in opts.state_specs().items())
    master = opts.master_spec and master_spec(opts.master_spec, lshape, opts.master_rounding)
    purposes = tuple(n for n, c in states if c.spec.rounding == "stochastic")
    if opts.master_rounding == "stochastic":
        purposes += ("master",)
    spec = KernelSpec(kind, states, master, opts.master_rounding, purposes, tuple(flags(dict(states))))
    group = _group(lshape or (1,), [c for _, c in states], master)
    rows = math.prod(lshape) // group
    per = max(1, chunk_numel // group)
    chunks = [(r, min(r + per, rows)) for r in range(0, rows, per)]
    return ParamLayout(spec, rows, group, chunks, global_offset(p))
