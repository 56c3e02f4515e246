"""Shared machinery of the low-bit optimizers: layouts, zero states, the chunk loop, state_dict dtypes."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from .codec import StateCodec
from .dist import local, shard_group, wrap_like
from .fused import ChunkBatch, run_fused
from .kernels import KERNELS
from .layout import ParamLayout, build_layout
from .rng import chunk_keys


class LowBitOptimizer(Optimizer):
    """Base class: subclasses set ``options_cls`` and ``kind`` and implement ``flags`` and ``hyper``.

    State of a parameter ``p`` (all placed like ``p``; see ``codec`` for the layout): ``step`` (fp32 scalar),
    for each state name ``<name>`` (native) or ``<name>_codes`` / ``<name>_scales``, and ``master_comp``
    (bf16) with Kahan master weights. Groups may carry ``param_names`` (FQNs; they key the random streams).
    The update itself is ``optim.kernels``' chunk function, compiled (``fused``, default; with ``batch_numel``
    small chunks several per call) or eager (``fused=False``: the reference, op by op, several times slower than torch's
    foreach AdamW; for checks, not for training).
    """

    options_cls: type
    kind: str
    chunk_numel: int = 1 << 18
    """Elements per chunk (about): the update's temporaries are a few fp32 copies of one chunk (1 MiB each),
    whatever the parameter's size. Part of the random streams' keys: change it and stochastic rounding draws
    other (equally good) bits."""
    call_chunks: int = 4
    """Fused update of a parameter that draws no random bits: up to this many consecutive chunks per compiled
    call (the same bits: rows are independent and no stream key tells chunks apart). A call costs ~0.1-0.25
    ms on CPU beyond its kernel; the temporaries stay a few fp32 copies of ``call_chunks`` chunks (4 MiB
    each)."""

    def __init__(self, params, **defaults: Any) -> None:
        super().__init__(params, defaults)
        self._options_cache: dict[Any, Any] = {}
        self._layouts: dict[torch.Tensor, tuple[Any, ParamLayout]] = {}
        self.in_backward_stand_in: Callable[[torch.Tensor], None] | None = None
        """Set by the peak planner, which has no values to update with: the ``in_backward`` hooks call it with
        each parameter in place of its update (it counts the update's workspace), then free the gradient."""
        self._grad_sq = torch.zeros((), dtype=torch.float64)
        self._grad_group = None  # FSDP2: the gradients' shard group, over which the squared norms add up
        for gi, group in enumerate(self.param_groups):
            if self.options(group).in_backward:  # validated here too, before any step
                for i, p in enumerate(group["params"]):
                    p.register_post_accumulate_grad_hook(functools.partial(self._step_in_backward, gi, i))

    @property
    def updates_in_backward(self) -> bool:
        """Some group has ``in_backward``: its parameters are updated by hooks in the backward."""
        return any(self.options(g).in_backward for g in self.param_groups)

    def grad_norm_in_backward(self) -> torch.Tensor:
        """The 2-norm of the gradients the ``in_backward`` hooks used since the last ``zero_grad`` (fp64, on
        their device): what gradient clipping would have measured, as torchtitan logs it. Under FSDP2 each rank
        holds its shards' part: a collective (every rank of the shard group calls it, as torchtitan's logging
        does)."""
        sq = self._grad_sq
        if self._grad_group is not None:
            sq = sq.clone()
            torch.distributed.all_reduce(sq, group=self._grad_group)
        return sq.sqrt()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, and the ``in_backward`` gradient norm starts again."""
        super().zero_grad(set_to_none)
        self._grad_sq = torch.zeros_like(self._grad_sq)

    def options(self, group: dict[str, Any]):
        """The validated options of a param group, cached by its hyperparameters except the LR (the scheduler
        changes it every step; the update reads ``group["lr"]`` itself)."""
        skip = ("params", "param_names", "lr", "initial_lr")
        key = tuple(sorted((k, repr(v)) for k, v in group.items() if k not in skip))
        if key not in self._options_cache:
            self._options_cache[key] = self.options_cls.from_group(group)
        return self._options_cache[key]

    def flags(self, opts, codecs: dict[str, StateCodec]) -> tuple[str, ...]:
        """The ``KernelSpec.flags`` of a parameter with these options and state codecs."""
        raise NotImplementedError

    def hyper(self, group: dict[str, Any], opts, step: int) -> list[float]:
        """The step's scalars (``optim.kernels``' ``*_HYPER``), computed in fp64 and stored as fp32."""
        raise NotImplementedError

    def layout(self, p: torch.Tensor, opts) -> ParamLayout:
        """``p``'s layout, built on first use (and again only if its group's options change)."""
        held = self._layouts.get(p)
        if held is None or held[0] is not opts:
            flags = lambda codecs: self.flags(opts, codecs)  # noqa: E731
            held = (opts, build_layout(p, opts, self.kind, flags, self.chunk_numel))
            self._layouts[p] = held
        return held[1]

    def codec(self, p: torch.Tensor, name: str) -> StateCodec:
        """The codec state ``name`` of ``p`` is stored with (its format, or fp32 if the shard does not fit)."""
        return self.layout(p, self.options(self._group_of(p))).spec.codec(name)

    def read(self, p: torch.Tensor, name: str) -> torch.Tensor:
        """fp32 values of state ``name`` of ``p``'s local shard (a new tensor; for tests and analysis)."""
        codec, state = self.codec(p, name), self.state[p]
        return codec.decode({s: local(state[name + s]) for s in codec.dtypes()}, tuple(local(p).shape))

    def _group_of(self, p: torch.Tensor) -> dict[str, Any]:
        return next(g for g in self.param_groups if any(q is p for q in g["params"]))

    def init_state(self, p: torch.Tensor, state: dict, lay: ParamLayout) -> None:
        """Create the zero states of ``p`` (placed like ``p``), never as fp32 tensors of ``p``'s size."""
        state["step"] = torch.zeros((), dtype=torch.float32)
        lp = local(p)
        for name, codec in lay.spec.states:
            gshapes = codec.part_shapes(tuple(p.shape))
            for suffix, part in codec.zeros(tuple(lp.shape), lp.device).items():
                state[name + suffix] = wrap_like(p, part, gshapes[suffix])
        if lay.spec.master_rounding == "kahan":
            comp = torch.zeros(lp.shape, dtype=torch.bfloat16, device=lp.device)
            state["master_comp"] = wrap_like(p, comp, tuple(p.shape))

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient.

        Args:
            closure: as torch's optimizers take it: called first, with gradients enabled, to recompute the
                loss (and the gradients it backpropagates); its return value is returned.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        batch = ChunkBatch(self.chunk_numel)
        for gi, group in enumerate(self.param_groups):
            opts = self.options(group)
            hypers: dict[tuple, torch.Tensor] = {}  # the group's step scalars, per (step, device)
            for i, p in enumerate(group["params"]):
                if p.grad is not None:
                    self._update(p, _fqn(group, gi, i), group, opts, hypers, batch)
        batch.flush()
        return loss

    @torch.no_grad()
    def _step_in_backward(self, gi: int, i: int, p: torch.Tensor) -> None:
        """``in_backward``: update ``p`` (parameter ``i`` of group ``gi``) as ``step()`` would, then free its
        gradient."""
        g = local(p.grad)  # its norm in one reduction, accumulated in fp64: no fp32 copy of the gradient
        # FSDP2 calls this hook on each sharded parameter after its reduce-scatter: the norm's group
        if self._grad_group is None:
            self._grad_group = shard_group(p.grad)
        self._grad_sq = self._grad_sq.to(g.device) + torch.linalg.vector_norm(g, dtype=torch.float64).square()
        if self.in_backward_stand_in is not None:
            self.in_backward_stand_in(p)
        else:
            group = self.param_groups[gi]
            batch = ChunkBatch(self.chunk_numel)
            self._update(p, _fqn(group, gi, i), group, self.options(group), {}, batch)
            batch.flush()
        p.grad = None

    def _update(self, p: torch.Tensor, fqn: str, group: dict[str, Any], opts, hypers: dict, batch) -> None:
        lay, state = self.layout(p, opts), self.state[p]
        if not state:
            self.init_state(p, state, lay)
        state["step"] += 1
        step = int(state["step"].item())
        dev = local(p).device
        hyper = hypers.get((step, dev))
        if hyper is None:
            hyper = torch.tensor(self.hyper(group, opts, step), dtype=torch.float32).to(
                dev, non_blocking=True
            )
            hypers[(step, dev)] = hyper
        keys = chunk_keys(opts.seed, fqn, step, lay.offset, lay.spec.purposes, lay.starts, dev)
        views = lay.tensors(p, state)
        spans = lay.merged(self.call_chunks) if opts.fused and keys is None else lay.chunks
        for k, (r0, r1) in enumerate(spans):
            chunk = views if len(spans) == 1 else [t[r0:r1] for t in views]
            key = None if keys is None else keys[k]
            if not opts.fused:
                KERNELS[lay.spec.kind](lay.spec, chunk[0], chunk[1], hyper, key, *chunk[2:])
            elif (r1 - r0) * lay.group <= opts.batch_numel:
                batch.add(lay.spec, chunk, hyper, key)
            else:
                run_fused(lay.spec, chunk, hyper, key)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then each state tensor as it was saved, on its parameter's device: torch casts every
        floating-point parameter's states to the parameter's dtype, which would turn uint8 codes into floats
        and round the fp32 block scales and moments of a bf16 parameter to bf16 (a resumed run would then
        differ from the uninterrupted one). ``step`` stays as torch loads it."""
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = dict(zip(ids, (p for g in self.param_groups for p in g["params"]), strict=True))
        for pid, st in saved.items():
            mine = self.state[params[pid]]
            for k, v in st.items():
                if torch.is_tensor(v) and k != "step":
                    mine[k] = v.to(device=mine[k].device)


def _fqn(group: dict[str, Any], gi: int, i: int) -> str:
    """The name that keys parameter ``i`` of group ``gi``'s random streams: its FQN, else ``"<gi>.<i>"``."""
    names = group.get("param_names")
    return names[i] if names else f"{gi}.{i}"
