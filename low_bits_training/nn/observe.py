"""A tiny observer registry: the quantized matmul reports each GEMM's operands here.

``nn`` knows nothing of statistics: it calls ``emit`` with the high-precision operands and their specs; whoever
wants them (titan/numerics.py: statistics, NaN detection) ``add``s a callback. Which module is running is
set from outside with ``set_module`` (forward / backward pre-hooks), because a ``LinearPlan`` is shared by
many layers and does not know its own name. With no observer installed ``emit`` returns at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from low_bits_training.formats import QuantSpec

from .roles import Role

Observer = Callable[[str, Role, torch.Tensor, QuantSpec | None], None]
"""``fn(module_fqn, role, high_precision_operand, spec_or_None)``; the operand is 2-D and must not be changed."""

_observers: list[Observer] = []
_module: list[str] = [""]


def add(fn: Observer) -> Callable[[], None]:
    """Install an observer.

    Returns:
        A function that removes it again.
    """
    _observers.append(fn)
    return lambda: _observers.remove(fn) if fn in _observers else None


def set_module(fqn: str) -> None:
    """Name the module whose GEMMs run next (called by hooks, see titan/numerics.py)."""
    _module[0] = fqn


def current_module() -> str:
    return _module[0]


def emit(operands: tuple[tuple[Role, torch.Tensor, QuantSpec | None], ...]) -> None:
    """Report one GEMM's operands ``((role, tensor, spec), ...)`` to every observer (no-op without any)."""
    if not _observers:
        return
    for role, t, spec in operands:
        for fn in _observers:
            fn(_module[0], role, t, spec)


OutputObserver = Callable[[str, str, torch.Tensor], None]
"""``fn(module_fqn, gemm, product)``: a GEMM's fp32 product (``"forward"`` | ``"dgrad"`` | ``"wgrad"``)."""

_output_observers: list[OutputObserver] = []


def add_output(fn: OutputObserver) -> Callable[[], None]:
    """Install an observer of GEMM products (where an overflow inside the quantized GEMM first shows).

    Returns:
        A function that removes it again.
    """
    _output_observers.append(fn)
    return lambda: _output_observers.remove(fn) if fn in _output_observers else None


def output(gemm: str, y: torch.Tensor) -> torch.Tensor:
    """Report a GEMM's product to every output observer; returns ``y`` unchanged."""
    for fn in _output_observers:
        fn(_module[0], gemm, y)
    return y
