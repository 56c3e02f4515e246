"""Shared machinery of the low-bit optimizers: state layout, shards, random streams, state_dict dtypes."""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from .codec import StateCodec
from .dist import global_offset, local, shards_like, wrap_like
from .master import write_master
from .presets import PRESETS
from .rng import generator

_FP32 = StateCodec(PRESETS["fp32"])


class LowBitOptimizer(Optimizer):
    """Base class: subclasses set ``options_cls`` and implement ``_update``.

    State of a parameter ``p`` (all placed like ``p``; see ``codec`` for the layout): ``step`` (fp32 scalar),
    for each state name ``<name>`` (native) or ``<name>_codes`` / ``<name>_scales``, and ``master_comp``
    (bf16) with Kahan master weights. Groups may carry ``param_names`` (FQNs; they key the random streams).
    """

    options_cls: type
    chunk_numel: int = 1 << 20
    """Parameters are updated in slices of whole rows of about this many elements: rows are independent
    (blocks never cross a row), so the states come out the same, and the fp32 temporaries of a step stay
    O(chunk) instead of O(largest parameter)."""

    def __init__(self, params, **defaults: Any) -> None:
        super().__init__(params, defaults)
        self._options_cache: dict[Any, Any] = {}
        for group in self.param_groups:
            self.options(group)  # validate every group now, before any step

    def options(self, group: dict[str, Any]):
        """The validated options of a param group, cached by its hyperparameters except the LR (the scheduler
        changes it every step; the update reads ``group["lr"]`` itself)."""
        skip = ("params", "param_names", "lr", "initial_lr")
        key = tuple(sorted((k, repr(v)) for k, v in group.items() if k not in skip))
        if key not in self._options_cache:
            self._options_cache[key] = self.options_cls.from_group(group)
        return self._options_cache[key]

    def codec(self, p: torch.Tensor, name: str, opts) -> StateCodec:
        """The codec of state ``name`` of ``p``: its configured format if the shard fits it, else fp32."""
        spec = opts.state_specs()[name]
        c = StateCodec(spec)
        if c.native:
            return c
        shape, lshape = tuple(p.shape), tuple(local(p).shape)
        if p.numel() < opts.min_quantized_numel or p.dim() < 2 or not (c.fits(shape) and c.fits(lshape)):
            return _FP32
        glob, loc = c.part_shapes(shape), c.part_shapes(lshape)
        return c if all(shards_like(p, glob[k], loc[k]) for k in glob) else _FP32

    def read(self, p: torch.Tensor, state: dict, name: str, opts, rows=Ellipsis) -> torch.Tensor:
        """fp32 values of state ``name`` for the local rows ``rows`` (a slice of dim 0, or all)."""
        c = self.codec(p, name, opts)
        parts = {s: local(state[name + s])[rows] for s in c.dtypes()}
        return c.decode(parts, tuple(local(p)[rows].shape))

    def write(
        self, p: torch.Tensor, state: dict, name: str, opts, x: torch.Tensor, gen_fn, rows=Ellipsis
    ) -> None:
        """Quantize fp32 ``x`` (the local rows ``rows``) into state ``name`` (in place)."""
        c = self.codec(p, name, opts)
        g = gen_fn(name) if c.spec.rounding == "stochastic" else None
        for suffix, part in c.encode(x, g).items():
            local(state[name + suffix])[rows].copy_(part)

    def row_chunks(self, p: torch.Tensor) -> list:
        """Slices of dim 0 of ``p``'s local shard, each about ``chunk_numel`` elements (Ellipsis for 0-d)."""
        lp = local(p)
        if lp.dim() == 0 or lp.shape[0] == 0:
            return [Ellipsis]
        per = max(1, self.chunk_numel // max(1, lp[0].numel()))
        return [slice(r, r + per) for r in range(0, lp.shape[0], per)]

    def init_state(self, p: torch.Tensor, state: dict, opts) -> None:
        """Create the zero states of ``p`` (placed like ``p``)."""
        state["step"] = torch.zeros((), dtype=torch.float32)
        lp = local(p)
        for name in opts.state_specs():
            c = self.codec(p, name, opts)
            gshapes = c.part_shapes(tuple(p.shape))
            for suffix, part in c.encode(torch.zeros(lp.shape, device=lp.device)).items():
                state[name + suffix] = wrap_like(p, part.clone(), gshapes[suffix])
        if opts.master_rounding == "kahan":
            state["master_comp"] = wrap_like(
                p, torch.zeros(lp.shape, dtype=torch.bfloat16, device=lp.device), tuple(p.shape)
            )

    def gen_fn(self, p: torch.Tensor, fqn: str, step: int, opts, rows=Ellipsis):
        """name -> generator of that stream for this parameter shard, row chunk and step."""
        offset = global_offset(p)
        start = rows.start if isinstance(rows, slice) else 0
        return lambda name: generator(opts.seed, fqn, step, offset, f"{name}@{start}", local(p).device)

    def finish(self, p: torch.Tensor, state: dict, opts, w32: torch.Tensor, gen_fn, rows=Ellipsis) -> None:
        """Write the updated fp32 weights (the local rows ``rows``) back on the master grid."""
        comp = local(state["master_comp"])[rows] if opts.master_rounding == "kahan" else None
        g = gen_fn("master") if opts.master_rounding == "stochastic" else None
        write_master(local(p)[rows], w32, opts.master_spec, opts.master_rounding, comp, g)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient (closures are not supported)."""
        if closure is not None:
            raise ValueError("closures are not supported")
        for gi, group in enumerate(self.param_groups):
            opts = self.options(group)
            names = group.get("param_names") or [f"{gi}.{i}" for i in range(len(group["params"]))]
            for p, fqn in zip(group["params"], names, strict=True):
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self.init_state(p, state, opts)
                state["step"] += 1
                step = int(state["step"].item())
                for rows in self.row_chunks(p):
                    self._update(p, state, group, opts, step, self.gen_fn(p, fqn, step, opts, rows), rows)
        return None

    def _update(self, p, state, group, opts, step, gen_fn, rows) -> None:
        """Update the local rows ``rows`` of ``p`` and its states."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, then each state back to the dtype it was saved in (torch casts every floating-point
        parameter's states to the parameter dtype, which would turn uint8 codes into fp32)."""
        dtypes = {
            pid: {k: v.dtype for k, v in st.items() if torch.is_tensor(v)}
            for pid, st in state_dict["state"].items()
        }
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, kinds in dtypes.items():
            st = self.state[params[pid]]
            for k, dt in kinds.items():
                if st[k].dtype != dt:
                    st[k] = st[k].to(dt)
