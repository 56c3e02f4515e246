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

from .kernels import KERNELS
from .layout import KernelSpec

_COMPILED: dict[KernelSpec, Callable] = {}
_OPTIONS = {"emulate_precision_casts": True}
"""Keep eager's rounding of every cast (inductor may otherwise fold an fp32 -> bf16 -> fp32 pair) and, on GPU,
no fused multiply-adds the eager kernels do not make."""


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
    if spec not in _COMPILED:
        fn = torch.compile(_own_copy(spec), fullgraph=True, options=_OPTIONS)
        _COMPILED[spec] = fn
    return _COMPILED[spec]


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
    try:
        fn(w, g, hyper, keys, *parts)
    except torch._dynamo.exc.BackendCompilerFailed as e:
        raise RuntimeError(
            f"compiling the fused low-bit optimizer update failed ({type(e).__name__}); set "
            "optimizer_kwargs.fused = false (or [optimizer] implementation = 'for-loop') for the eager update"
        ) from e
