"""What the update of one parameter makes beside its states and gradient while it runs (its workspace), for
the peak planner (``titan/runtime/peak.py``) where the update runs inside the backward (``in_backward``): there
the workspace lands while the activations are alive.

The compiled update's buffers are inductor's choice, so they are measured, not modelled: the update of one real
parameter with the same kernel spec and dtype (zeros, on the CPU, outside the planner's fake mode), its third
step's peak above what it held (``optim.memory.allocated_peak``), per element. That figure times the elements
of the parameter's largest call (one chunk when the update draws random bits, ``call_chunks`` chunks when it
does not) is its workspace. Cached per (optimizer, spec, dtype, fused) for the process: the first costs one
compile of the update, which the run's own first step then finds in inductor's cache.
``tests/optim/test_workspace.py`` holds it to the allocator's peak of real updates.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from low_bits_training.upstream import unset_fake_temporarily

from .dist import local
from .memory import allocated_peak

MEASURE_NUMEL = 1 << 16
"""Elements of the stand-in parameter a measurement updates (a parameter with fewer: its own shape)."""
_PER_ELEMENT: dict[tuple, float] = {}


def call_numel(opt: Any, p: torch.Tensor, group: dict[str, Any] | None = None) -> int:
    """Elements of the largest call the update of ``p`` makes (``LowBitOptimizer._update``'s spans; a
    parameter whose chunks are batched: all of them in one call). ``group``: ``p``'s, if the caller has it."""
    opts = opt.options(group or opt._group_of(p))
    lay = opt.layout(p, opts)
    spans = lay.merged(opt.call_chunks) if opts.fused and not lay.spec.purposes else lay.chunks
    sizes = [(r1 - r0) * lay.group for r0, r1 in spans]
    if opts.fused and max(sizes) <= opts.batch_numel:
        return sum(sizes)
    return max(sizes)


def per_element(opt: Any, p: torch.Tensor, group: dict[str, Any] | None = None) -> float:
    """Bytes the update of ``p`` makes at its peak per element of a call, measured once per kind of update."""
    group = group or opt._group_of(p)
    opts = opt.options(group)
    lay, w = opt.layout(p, opts), local(p)
    key = (type(opt), lay.spec, w.dtype, opts.fused)
    if key not in _PER_ELEMENT:
        _PER_ELEMENT[key] = _measure(opt, group, tuple(w.shape), w.dtype)
    return _PER_ELEMENT[key]


def update_workspace(opt: Any, p: torch.Tensor, group: dict[str, Any] | None = None) -> int:
    """Bytes the update of ``p`` makes at once beside its states and gradient (``group``: ``p``'s, if known)."""
    group = group or opt._group_of(p)
    return int(per_element(opt, p, group) * call_numel(opt, p, group))


def _measure(opt: Any, group: dict[str, Any], shape: tuple[int, ...], dtype: torch.dtype) -> float:
    if math.prod(shape) > MEASURE_NUMEL:  # whole rows of the same width: the same spec, fewer of them
        shape = (max(1, MEASURE_NUMEL // shape[-1]), shape[-1]) if len(shape) > 1 else (MEASURE_NUMEL,)
    options = {k: v for k, v in group.items() if k not in ("params", "param_names")}
    with unset_fake_temporarily():
        q = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        twin = type(opt)([{**options, "params": [q], "in_backward": False, "batch_numel": 0}])
        for _ in range(2):  # states made, update compiled
            q.grad = torch.zeros_like(q)
            twin.step()
        q.grad = torch.zeros_like(q)
        return allocated_peak(twin.step) / q.numel()
