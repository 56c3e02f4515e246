"""The fused update: each chunk update of ``optim.kernels`` compiled once per ``KernelSpec``.

torch.compile (inductor: C++ on CPU, Triton on GPU) turns decode -> update -> encode of a chunk into a few
loops over it, with no fp32 copy of a state ever made whole. The device is whatever the tensors are on.

Compiles: one per spec and dtype combination. The chunk's row count is marked dynamic, so every chunk of
every parameter of that spec (full chunks, the last partial chunk, other parameter sizes) reuses it. Each
spec gets its own copy of the function (its own code object), because torch.compile keeps its cache, and
its limit of 8 recompiles, per code object: specs never evict or crowd out each other.
"""

from __future__ import annotations

import types
from collections.abc import Callable

import torch

from low_bits_training.upstream import inductor_as_eager_here

from .kernels import KERNELS
from .layout import KernelSpec

_COMPILED: dict[KernelSpec, Callable] = {}


def kept_guards(entries) -> list[bool]:
    """Which of a compiled update's guards dynamo keeps (``torch.compile``'s ``guard_filter_fn``): those on
    the tensors (dtype, device, sizes, strides), the dynamic-shape relations and the global state (grad mode,
    autocast, ...); not those on the ``KernelSpec`` the update reads (its nested fields: most of the guard
    tree), as a compiled function's ``spec`` never changes (one function per spec; the spec is frozen and
    decides whether ``keys`` is None). Those guards cost ~70 us a call on CPU: the debug Llama mix's default
    step took 31.95 ms with them and 28.01 ms without (medians of 60 interleaved steps in one process, the
    same bits; docs/optimizers.md)."""
    return [e.guard_type in ("TENSOR_MATCH", "SHAPE_ENV", "GLOBAL_STATE") for e in entries]


def _options() -> dict:
    """Inductor as eager (``upstream.INDUCTOR_AS_EAGER``: eager's rounding of every cast, where inductor may fold
    an fp32 -> bf16 -> fp32 pair; on a GPU, correctly rounded divides and fp32 subnormals kept, as the eager
    update has them: on an H200 the eager update equalled the CPU's bit for bit and the fused one, compiled
    with the first switch alone, did not, docs/optimizers.md); check only the guards ``kept_guards`` keeps."""
    return {**inductor_as_eager_here(), "guard_filter_fn": kept_guards}


def _compiled(fn: Callable) -> Callable:
    # new options each time: torch.compile pops guard_filter_fn from the dict it is given
    return torch.compile(fn, fullgraph=True, options=_options())


def _own_copy(spec: KernelSpec) -> Callable:
    kernel = KERNELS[spec.kind]

    def chunk_update(*tensors):
        return kernel(spec, *tensors)

    name = f"lbt_{spec.kind}_chunk_{len(_COMPILED)}"
    code = chunk_update.__code__.replace(co_name=name)
    return types.FunctionType(code, chunk_update.__globals__, name, None, chunk_update.__closure__)


def compiled_update(spec: KernelSpec) -> Callable:
    """The compiled chunk update of ``spec`` (made on first use, then cached for the process).

    Returns:
        ``fn(w, g, hyper, keys, *parts)``, the arguments of ``optim.kernels``; the first compile happens on
        its first call (seconds on CPU; needs a C++ compiler there, Triton on GPU).
    """
    fn = _COMPILED.get(spec)
    if fn is None:
        fn = _COMPILED[spec] = _compiled(_own_copy(spec))
    return fn


def run_fused(spec: KernelSpec, tensors: list[torch.Tensor], hyper, keys) -> None:
    """Run the compiled update on one chunk.

    Args:
        spec: the parameter's kernel spec.
        tensors: (rows, ...) views in kernel order (parameter, gradient, state parts, compensation).
        hyper: the step's scalars (fp32 vector on the parameter's device).
        keys: the chunk's key row, or None.

    Raises:
        RuntimeError: torch.compile failed (no C++ compiler, unsupported platform, ...), naming the option that
            selects the eager update instead; the compiler's error is chained.
    """
    fn = compiled_update(spec)
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)
    w, g, *parts = tensors
    _call(fn, w, g, hyper, keys, *parts)


def _call(fn: Callable, *args) -> None:
    try:
        fn(*args)
    except torch._dynamo.exc.BackendCompilerFailed as e:
        raise RuntimeError(
            f"compiling the fused low-bit optimizer update failed ({type(e).__name__}); set "
            "optimizer_kwargs.fused = false (or [optimizer] implementation = 'for-loop') for the eager update"
        ) from e


_BATCHED: dict[tuple, Callable] = {}


def _own_batch(spec: KernelSpec, n: int, arity: int) -> Callable:
    kernel = KERNELS[spec.kind]

    def chunks_update(hyper, *flat):
        for i in range(n):
            w, g, keys, *parts = flat[i * arity : (i + 1) * arity]
            kernel(spec, w, g, hyper, keys, *parts)

    name = f"lbt_{spec.kind}_batch_{len(_BATCHED)}"
    code = chunks_update.__code__.replace(co_name=name)
    return types.FunctionType(code, chunks_update.__globals__, name, None, chunks_update.__closure__)


class ChunkBatch:
    """Small chunks of one step, updated several per compiled call (one call's overhead instead of one each).

    A compiled call costs about a hundred microseconds on CPU beyond its kernel, which dominates the update of
    a norm or a bias. Chunks with the same spec, dtypes, row widths and step scalars (``hyper``) are collected
    into a bin; a bin runs as one compiled function that applies the chunk update to each of its chunks in
    turn (the same ops on the same tensors as one call each, so the same bits, stochastic rounding included:
    each chunk keeps its own key row), when it holds ``max_items`` chunks or ``max_numel`` elements, and at
    ``flush``. Compiles: one per spec, dtypes, row widths and bin size (rows are dynamic, as in
    ``run_fused``).
    """

    def __init__(self, max_numel: int, max_items: int = 16) -> None:
        self.max_numel, self.max_items = max_numel, max_items
        self._bins: dict[tuple, tuple[KernelSpec, torch.Tensor, list, list[int]]] = {}

    def add(self, spec: KernelSpec, tensors: list[torch.Tensor], hyper, keys) -> None:
        """Queue one chunk (``run_fused``'s arguments); it is updated by this ``add`` or a later one, or by
        ``flush``: read nothing it writes before then."""
        sig = (spec, id(hyper), tuple((t.dtype, t.device, t.shape[1:]) for t in tensors))
        held = self._bins.setdefault(sig, (spec, hyper, [], [0]))
        held[2].append((tensors, keys))
        held[3][0] += tensors[0].numel()
        if len(held[2]) >= self.max_items or held[3][0] >= self.max_numel:
            del self._bins[sig]
            _run_batch(*held[:3])

    def flush(self) -> None:
        """Update every queued chunk."""
        bins, self._bins = self._bins, {}
        for spec, hyper, items, _ in bins.values():
            _run_batch(spec, hyper, items)


def _run_batch(spec: KernelSpec, hyper, items: list) -> None:
    if len(items) == 1:
        run_fused(spec, items[0][0], hyper, items[0][1])
        return
    arity = len(items[0][0]) + 1
    sig = (spec, arity, tuple((t.dtype, t.device, t.shape[1:]) for ts, _ in items for t in ts))
    if sig not in _BATCHED:
        _BATCHED[sig] = _compiled(_own_batch(spec, len(items), arity))
    flat = []
    for (w, g, *parts), keys in items:
        for t in (w, g, *parts):
            torch._dynamo.maybe_mark_dynamic(t, 0)
        flat += [w, g, keys, *parts]
    _call(_BATCHED[sig], hyper, *flat)
