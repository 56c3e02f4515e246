"""In-graph numerics probes: each quantized layer records its operands' statistics and NaN flags itself.

A probe is two tensors a layer owns (``LayerState.stats`` and ``.flags``), updated in place inside the
quantized matmul's forward and backward. That is all torch.compile needs: no module hooks, no Python
callbacks, no host syncs in the step (compiled graphs may mutate buffers, in backward too). Whoever wants
the numbers (titan/runtime/numerics) reads and resets the tensors between steps.

- ``stats[i]``: the raw statistics vector (``numerics.stats``) of ``ROLES[i]``, combined over the calls of a
  step (sums add, amax by max, the smallest scale by min), computed from the very values the GEMM used.
- ``flags[j]``: the count of non-finite checks that failed in ``FLAG_SLOTS[j]`` (each GEMM operand, each GEMM
  product) since the last reset.

What is recorded is chosen by the process-wide ``ProbeMode`` (a constant guarded by torch.compile: switching
statistics on for a step compiles a second graph once, then both are reused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from low_bits_training.formats import QuantSpec
from low_bits_training.numerics import SIZE, combine, identity, operand_stats
from low_bits_training.numerics.whatif import combine_whatif, whatif_stats

from .roles import GEMMS, ROLE_NAMES

FLAG_SLOTS: tuple[str, ...] = (*ROLE_NAMES, *(f"{g}.output" for g in GEMMS))
"""The non-finite flag slots of a layer: the six operand roles, then the three GEMM products."""


@dataclass(frozen=True)
class ProbeMode:
    """What quantized layers record this step."""

    stats: bool = False
    """Raw quantization statistics of every quantized operand."""
    nonfinite: bool = False
    """A NaN / Inf flag per operand and per GEMM product."""


_mode = [ProbeMode()]  # the process-wide mode (see ``set_mode``)


def set_mode(mode: ProbeMode) -> None:
    """Set what layers record from now on (the trainer sets it per step)."""
    _mode[0] = mode


def mode() -> ProbeMode:
    return _mode[0]


class LayerState(NamedTuple):
    """The tensors a quantized layer carries beside its parameters (all may be None)."""

    key: torch.Tensor | None = None
    """int64 0-d: the layer's random-stream key (``nn.rng.layer_key``)."""
    stats: torch.Tensor | None = None
    """float64 (len(ROLES), SIZE): raw statistics per role."""
    flags: torch.Tensor | None = None
    """float32 (len(FLAG_SLOTS),): non-finite counts per slot."""


NO_STATE = LayerState()
"""A layer without key or probes (plain functional use)."""
PROBE_OFF = ProbeMode()
"""Record nothing."""


def new_stats(device=None) -> torch.Tensor:
    """A fresh (reset) statistics tensor for one layer."""
    return identity().to(device).repeat(len(ROLE_NAMES), 1)


def new_flags(device=None) -> torch.Tensor:
    """A fresh (reset) flags tensor for one layer."""
    return torch.zeros(len(FLAG_SLOTS), dtype=torch.float32, device=device)


def reset(state: LayerState) -> None:
    """Reset a layer's statistics and flags in place (between steps, outside any graph)."""
    if state.stats is not None:
        state.stats.copy_(identity().to(state.stats.device).expand_as(state.stats))
    if state.flags is not None:
        state.flags.zero_()


def nonfinite(t: torch.Tensor) -> torch.Tensor:
    """1.0 if ``t`` holds a NaN or Inf, else 0.0 (fp32 0-d; no host sync)."""
    # One fp32 sum, no boolean copy: a NaN / Inf anywhere makes the sum non-finite.
    return torch.isfinite(t.detach().sum(dtype=torch.float32)).logical_not().to(torch.float32)


def record_operand(
    state: LayerState, mode: ProbeMode, role: int, t: torch.Tensor, spec: QuantSpec | None, q=None
) -> torch.Tensor | None:
    """Record one GEMM operand (the high-precision tensor ``t``, and its cast ``q`` if already made).

    Returns:
        the non-finite flag value added to the role's slot (for ``record_flag`` of a role that reuses this
        cast), or None when no flag is recorded.
    """
    bad = nonfinite(t) if mode.nonfinite and state.flags is not None else None
    record_flag(state, role, bad)
    if mode.stats and spec is not None and state.stats is not None:
        raw = operand_stats(t, spec, q).to(state.stats.dtype)
        state.stats[role].copy_(combine(state.stats[role], raw))
    return bad


def record_flag(state: LayerState, role: int, bad: torch.Tensor | None) -> None:
    """Add a non-finite flag value ``bad`` (None: flags off) to a role's slot: ``record_operand``'s, and that
    of an operand whose cast is reused from an earlier role of the same tensor (``LinearPlan.reused_casts``;
    statistics steps do not reuse casts)."""
    if bad is not None and state.flags is not None:
        state.flags[role].add_(bad)


def record_whatif(
    stats: torch.Tensor | None,
    mode: ProbeMode,
    role: int,
    t: torch.Tensor,
    specs: tuple[QuantSpec | None, ...],
    keys: tuple[torch.Tensor | None, ...],
) -> None:
    """Record what-if statistics of one operand: what each alternative ``specs[k]`` would do to ``t``.

    Statistics steps only (``mode.stats``); nothing feeds back into the computation.

    Args:
        stats: the layer's what-if buffer, float64 (len(specs), len(ROLE_NAMES), WHATIF_SIZE), or None.
        mode: what the probe records.
        role: index into ``ROLES``.
        t: the high-precision operand as the GEMM receives it (2-D, natural orientation).
        specs: per alternative its spec for this role (axis along the role's contraction dim), or None.
        keys: per alternative the stochastic-rounding key (None: nearest rounding, or no key).
    """
    if not mode.stats or stats is None:
        return
    for k, spec in enumerate(specs):
        if spec is not None:
            raw = whatif_stats(t, spec, keys[k]).to(stats.dtype)
            stats[k, role].copy_(combine_whatif(stats[k, role], raw))


def record_output(state: LayerState, mode: ProbeMode, gemm: int, y: torch.Tensor) -> None:
    """Record a GEMM product's non-finite flag (where an overflow inside the GEMM first shows)."""
    if mode.nonfinite and state.flags is not None:
        state.flags[len(ROLE_NAMES) + gemm].add_(nonfinite(y))


__all__ = [
    "FLAG_SLOTS",
    "SIZE",
    "LayerState",
    "NO_STATE",
    "PROBE_OFF",
    "ProbeMode",
    "mode",
    "new_flags",
    "new_stats",
    "nonfinite",
    "record_flag",
    "record_operand",
    "record_output",
    "record_whatif",
    "reset",
    "set_mode",
]
