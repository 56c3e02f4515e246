"""Host snapshots of a training state, for the autopilot's rollback (``[quantize.autopilot] spike_z``).

A snapshot holds, per rank, what the next steps of training read and write: every parameter and buffer of
the model parts (their local shards under FSDP2 / TP; buffers hold the quantized layers' keys, probes and
delayed-scaling amax histories), each optimizer's per-parameter state as it is stored (a low-bit state
stays in its own format) and its groups' hyperparameters, the LR schedulers and the trainer's own state
(step, tokens seen). Restoring copies it back in place, so the tensors compiled graphs hold stay the same
objects (no recompile). The data position is not read back from the dataloader: ``Snapshots`` keeps the
batches every step drew since the older snapshot and hands them out again. Every random stream derives
from (seed, step, microbatch, rank) (``titan/runtime/trainer.py``), so a restored state replays exactly.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

KEEP = 2
"""Snapshots kept: the newest and the one before it."""


_PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Tensor types copied as they are (a subclass, e.g. a quantized state, is deep-copied)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage: written in place, the DTensor changes), else ``t``."""
    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():  # to_local without autograd hands back the shard itself
        return t.to_local()


def _to_host(v):
    """A host copy of ``v`` (tensors copied; anything else deep-copied)."""
    if isinstance(v, torch.Tensor):
        local = _local(v.detach())
        if type(local) in _PLAIN:
            return local.to("cpu", copy=True)
        return copy.deepcopy(local).cpu()
    return copy.deepcopy(v)


def _in_place(live, saved) -> bool:
    """Write ``saved`` into ``live`` (its local shard) when they match in kind, shape and dtype."""
    if not (isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor)):
        return False
    target = _local(live)
    if type(target) not in _PLAIN or target.shape != saved.shape or target.dtype != saved.dtype:
        return False
    with torch.no_grad():
        target.copy_(saved)
    return True


def _copy_into(live, saved):
    """The value to keep for an optimizer state: ``live`` written in place where it can be, else a copy of
    ``saved`` (on ``live``'s device)."""
    if _in_place(live, saved):
        return live
    if isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor):
        return copy.deepcopy(saved).to(_local(live).device)
    return copy.deepcopy(saved)


def _tensors(model_parts) -> list[torch.Tensor]:
    out = []
    for m in model_parts:
        out.extend(p for _, p in m.named_parameters())
        out.extend(b for _, b in m.named_buffers())
    return out


def _optimizers(trainer) -> list:
    return list(getattr(trainer.optimizers, "optimizers", [trainer.optimizers]))


def _schedulers(trainer) -> list:
    return list(getattr(trainer.lr_schedulers, "schedulers", []))


def _nbytes(v) -> int:
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, dict):
        return sum(_nbytes(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return sum(_nbytes(x) for x in v)
    return 0


@dataclass
class Snapshot:
    """The state after step ``step`` (what step ``step + 1`` starts from)."""

    step: int
    tensors: list[torch.Tensor]
    optim: list[tuple[list[dict], list[dict]]]
    """Per optimizer: per-parameter states (in ``param_groups`` order) and the groups' hyperparameters."""
    schedulers: list[dict]
    trainer: dict
    seconds: float = 0.0

    @property
    def nbytes(self) -> int:
        return _nbytes(self.tensors) + sum(_nbytes(s) for s, _ in self.optim)


def take(trainer, step: int) -> Snapshot:
    """Copy ``trainer``'s state (after ``step``) to host memory."""
    t0 = time.perf_counter()
    tensors = [_to_host(t) for t in _tensors(trainer.model_parts)]
    optim = []
    for opt in _optimizers(trainer):
        params = [p for g in opt.param_groups for p in g["params"]]
        states = [{k: _to_host(v) for k, v in opt.state.get(p, {}).items()} for p in params]
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
        optim.append((states, groups))
    schedulers = [copy.deepcopy(s.state_dict()) for s in _schedulers(trainer)]
    state = copy.deepcopy(trainer.state_dict())
    return Snapshot(step, tensors, optim, schedulers, state, time.perf_counter() - t0)


def restore(trainer, snap: Snapshot) -> None:
    """Put ``snap`` back into ``trainer`` (in place where shapes allow); ``trainer.step`` becomes its step."""
    for live, saved in zip(_tensors(trainer.model_parts), snap.tensors, strict=True):
        if not _in_place(live, saved):  # a model tensor changed kind or shape since the snapshot
            raise RuntimeError(
                f"snapshot of step {snap.step}: cannot restore a {type(live).__name__} in place"
            )
    for opt, (states, groups) in zip(_optimizers(trainer), snap.optim, strict=True):
        params = [p for g in opt.param_groups for p in g["params"]]
        for p, saved in zip(params, states, strict=True):
            live = opt.state.get(p, {})
            if not saved:
                opt.state.pop(p, None)
                continue
            opt.state[p] = {k: _copy_into(live.get(k), v) for k, v in saved.items()}
        for g, saved in zip(opt.param_groups, groups, strict=True):
            g.update(copy.deepcopy(saved))
    for s, saved in zip(_schedulers(trainer), snap.schedulers, strict=True):
        s.load_state_dict(copy.deepcopy(saved))
    trainer.load_state_dict(copy.deepcopy(snap.trainer))
    trainer.step = snap.step


@dataclass
class Snapshots:
    """The newest ``KEEP`` snapshots of a run and the batches each step drew since the oldest of them.

    Args:
        every: a snapshot after every ``every``-th step (and after each checkpoint step, see ``due``).
        checkpoint_every: the checkpoint interval (0: no checkpoints).
        max_bytes: host bytes the kept snapshots may hold; a run that needs more keeps none (``off``).
    """

    every: int
    checkpoint_every: int
    max_bytes: int
    kept: list[Snapshot] = field(default_factory=list)
    batches: dict[int, list] = field(default_factory=dict)
    off: str = ""
    """Why no snapshots are kept (empty: they are)."""

    def due(self, step: int, first: bool) -> bool:
        """Take one before ``step`` runs (the state after ``step - 1``)? At this process's first step, after
        every ``every``-th step and after every checkpoint step (a rollback never crosses a checkpoint)."""
        if self.off:
            return False
        done = step - 1
        ckpt = self.checkpoint_every and done % self.checkpoint_every == 0
        return first or done % self.every == 0 or bool(ckpt)

    def add(self, snap: Snapshot) -> None:
        """Keep ``snap`` (dropping the oldest beyond ``KEEP`` and the batches before the oldest kept)."""
        if snap.nbytes * KEEP > self.max_bytes:
            self.off = (
                f"{KEEP} snapshots of {snap.nbytes / 2**30:.2f} GiB each pass quantize.autopilot.snapshot_gib "
                f"= {self.max_bytes / 2**30:g}"
            )
            self.kept.clear()
            self.batches.clear()
            return
        self.kept = [s for s in self.kept if s.step != snap.step][-(KEEP - 1) :] + [snap]
        oldest = self.kept[0].step
        self.batches = {k: v for k, v in self.batches.items() if k > oldest}

    def back_to(self, step: int) -> None:
        """After a rollback to ``step``: the snapshots of later steps belonged to the abandoned steps."""
        self.kept = [s for s in self.kept if s.step <= step]

    def record(self, step: int, batches: list) -> None:
        """The batches ``step`` drew (its last run's)."""
        if self.kept:
            self.batches[step] = list(batches)

    def target(self, step: int) -> Snapshot | None:
        """The snapshot to go back to from a spike seen at ``step``: the newest that undoes at least one
        update before it (``snap.step <= step - 2``), else the oldest kept; None when none is kept."""
        if not self.kept:
            return None
        back = [s for s in self.kept if s.step <= step - 2]
        return back[-1] if back else self.kept[0]
