"""Where a NaN / inf first appeared within one step, found without a host sync per tensor.

Every checked tensor adds one device flag (``~isfinite(t).all()``); the flags are read once, at the end of a
microbatch, and the first flagged entry in check order names the culprit. Pure: no torch.distributed (the
caller agrees across ranks).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class NonFinite(NamedTuple):
    """The first non-finite value seen: where, and in which tensor role."""

    step: int
    module: str
    """FQN of the module (``layers.0.attention.wq``), or ``"loss"`` / the parameter FQN for gradients."""
    role: str
    """GEMM operand role (``forward.input``, ``dgrad.grad_output``, ...), ``"loss"`` or ``"grad"``."""
    rank: int

    def message(self) -> str:
        """One line for the user."""
        return (
            f"non-finite value (NaN/Inf) first seen at step {self.step}, module {self.module}, "
            f"role {self.role}, rank {self.rank}"
        )


class FirstNonFinite:
    """Accumulates per-tensor non-finite flags in check order; ``first()`` reads them with one sync."""

    def __init__(self) -> None:
        self._names: list[tuple[str, str]] = []
        self._flags: list[torch.Tensor] = []

    def check(self, module: str, role: str, t: torch.Tensor) -> None:
        """Record whether ``t`` holds a NaN or inf (a device flag; no sync).

        Args:
            module: FQN to report.
            role: tensor role to report.
            t: a plain (local) tensor.
        """
        self._names.append((module, role))
        # One reduction pass, no boolean copy: a NaN / inf anywhere makes the fp32 sum non-finite (a sum of
        # finite values overflowing fp32, |sum| > 3.4e38, would be reported too: such values are broken anyway).
        self._flags.append(torch.isfinite(t.detach().sum(dtype=torch.float32)).logical_not())

    def first(self) -> tuple[str, str] | None:
        """``(module, role)`` of the first flagged tensor since the last ``reset``, or None."""
        if not self._flags:
            return None
        flags = torch.stack([f.to(self._flags[0].device) for f in self._flags])
        hit = torch.nonzero(flags).flatten().tolist()  # the one host sync
        return self._names[hit[0]] if hit else None

    def reset(self) -> None:
        self._names.clear()
        self._flags.clear()
