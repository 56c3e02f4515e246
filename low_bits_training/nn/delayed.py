"""Delayed scaling: a tensor scale from the amax history of an operand's past casts (Transformer Engine's
``DelayedScaling``), kept by the layer and updated inside its forward / backward like the probes.

A layer whose plan has roles with ``amax_history = N > 0`` owns a float32 buffer ``(len(ROLES), max N)``
(``new_history``); row i is role i's history, newest first. A cast of such a role

1. takes the amax of the tensor it casts (the global one: all-reduced MAX over the tensor-parallel shards of
   the operand, ``cast._global_amax``, then over the amax group, ``reduce_amax``);
2. scales with the history's amax: its max over the N entries ("max") or the newest one ("most_recent"),
   or, while the history holds nothing yet (0), the current amax (TE would use scale 1 there);
3. records the current amax as the newest entry (a non-finite amax is recorded as 0: "nothing known", so
   one NaN step does not poison every later scale). Only casts made with grad enabled record: evaluation
   forwards read the history but leave it alone.

Every rank must hold the same history, or a checkpoint (which stores one copy of a replicated buffer) would
not resume exactly: the trainer sets the **amax group**, the ranks that see different data (data parallel x
context parallel, ``titan.targets.delayed``), and the amax is all-reduced MAX over it. Without one (plain module
use) each process keeps its own history. One history entry per call: gradient accumulation and a layer called
twice per step each add entries.

**When the forward records.** A linear layer's forward casts (``forward.input``, ``forward.weight``) read
the history, and their amaxes are recorded when the layer's backward runs (``nn.functional.QuantMatmul``;
the backward's own casts record as they cast). So the forward never changes what it reads, and an
activation checkpoint's recompute, which runs the forward again inside the backward, reads the history as
the first pass did and records nothing (its backward never runs): eager and compiled (where the recompute is
part of the backward graph and reads the buffer as it stands then), full and selective checkpointing, bit
for bit the run without (tests/nn/test_ac_delayed.py). Transformer Engine gets the same by keeping the
forward's scales for the recompute and skipping the update there. With one microbatch at a time (gradient
accumulation included) a cast sees the same history as when the forward recorded at once. Under pipeline
parallelism with several microbatches in flight, a forward reads the history without the amaxes of the
microbatches whose backward has not run yet; with activation checkpointing there, a recompute that runs
after an earlier microbatch's backward reads a history that backward extended (not bit for bit the first
pass: use delayed scaling without checkpointing under PP). The attention products (``nn.attention``) still
record in their forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from low_bits_training.formats import QuantSpec

from .roles import ROLES

_group: list[object] = [None]


def set_amax_group(group: object | None) -> None:
    """Set (or clear) the process group the amax of delayed-scaled casts is all-reduced over (MAX)."""
    _group[0] = group


def amax_group() -> object | None:
    return _group[0]


def history_length(specs: tuple[QuantSpec | None, ...]) -> int:
    """The history buffer's row length for a layer with these role specs (0: no delayed scaling)."""
    return max((s.amax_history for s in specs if s is not None), default=0)


def new_history(specs: tuple[QuantSpec | None, ...], device=None) -> torch.Tensor | None:
    """A fresh (all-zero: nothing known) history buffer for a layer, or None without delayed roles."""
    n = history_length(specs)
    return torch.zeros(len(ROLES), n, dtype=torch.float32, device=device) if n else None


def reduce_amax(amax: torch.Tensor) -> torch.Tensor:
    """The amax all-reduced (MAX) over the amax group, if one is set (fp32, same shape)."""
    group = _group[0]
    if group is not None:
        amax = amax.clone()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def history_amax(row: torch.Tensor, spec: QuantSpec, current: torch.Tensor) -> torch.Tensor:
    """The amax a delayed cast scales with (see the module doc, step 2).

    Args:
        row: the role's history row (newest first; only the first ``spec.amax_history`` entries count).
        spec: the role's spec.
        current: this cast's amax (keepdim shape).

    Returns:
        fp32 tensor of ``current``'s shape.
    """
    h = row[: spec.amax_history]
    past = h.amax() if spec.amax_compute == "max" else h[0]
    return torch.where(past > 0, past, current)


def record(row: torch.Tensor, spec: QuantSpec, current: torch.Tensor) -> None:
    """Push ``current`` (a non-finite one as 0) as the newest entry of the role's history row, in place."""
    n = spec.amax_history
    amax = current.reshape(1).to(row.dtype)
    amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
    row[:n].copy_(torch.cat((amax, row[: n - 1])))


def reference_amaxes(amaxes: list[float], spec: QuantSpec) -> list[float]:
    """The slow definition: the amax each of a sequence of casts scales with, from the plain list of the
    casts' own amaxes (what the history buffer must reproduce, tests/nn/test_delayed.py)."""
    out, seen = [], []
    for a in amaxes:
        window = seen[-spec.amax_history :]
        past = (max(window) if spec.amax_compute == "max" else window[-1]) if window else 0.0
        out.append(past if past > 0 else a)
        seen.append(a if a == a and abs(a) != float("inf") else 0.0)
    return out
