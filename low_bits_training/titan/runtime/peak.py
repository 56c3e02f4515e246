"""The peak memory of one rank of a run, planned before the run starts (docs/memory.md, "Peak memory").

``plan_peak`` builds what the trainer builds (the model with the launcher's precision plan, the spec's
``parallelize_fn``, ``config.optimizer.build``, ``config.loss.build``) on a fake process group of the run's
size under ``FakeTensorMode`` and runs torchtitan's own step code (``Trainer.post_dataloading_process``,
``Trainer._forward_backward_body``, the optimizers' ``step``) for two steps of the local batch, at most two
microbatches each. ``optim.memory.LiveStorages`` counts every storage from the op that makes it until its last
reference goes (512-B blocks on CUDA). The first step makes the optimizer states; the second is every later
step. A compiled run is built with torchtitan's own compile, partitioned as inductor would and run node by
node, each graph holding at least what inductor's own code of it holds (``titan/runtime/peak_compile.py``).
Not planned: pipeline parallelism. Not counted: the allocator's cache and fragmentation, CUDA / NCCL
workspaces, tensors outside the step.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.utils import get_spmd_context
from torchtitan.tools.utils import set_default_dtype
from torchtitan.trainer import Trainer

from low_bits_training.optim.budget import StateBytes
from low_bits_training.optim.memory import LiveStorages
from low_bits_training.optim.workspace import update_workspace
from low_bits_training.titan.platform.compat import (
    fake_process_group,
    fake_refusals,
    fake_tensor_mode,
    forget_shardings,
    forward_backward_body,
    titan_compile_backend,
)
from low_bits_training.titan.platform.cpu import gloo_staging
from low_bits_training.titan.runtime import peak_compile
from low_bits_training.titan.runtime.budget import planned

PARTS = ("parameters", "buffers", "gradients", "optimizer states", "forward and backward", "optimizer step")
"""What the plan names at the peak, in this order: the parameters as each rank stores them (FSDP2's shards),
the modules' buffers (RoPE's table), the gradients, the optimizer states, what the forward and backward make
(saved activations, FSDP2's gathered parameters and gradient buffers, logits, workspace), and what the
optimizer's step makes (its workspace)."""
MICROBATCHES = 2
"""Microbatches per planned step at most: from the second on, gradients are held while a microbatch runs."""


@dataclass
class PeakPlan:
    """One rank's planned peak (bytes) and what is live at it."""

    first: int
    """The first step's peak (the optimizer states are made in it)."""
    later: int
    """A later step's peak (states held throughout)."""
    parts: dict[str, int] = field(default_factory=dict)
    """Part (``PARTS``) -> bytes live at the larger of the two peaks."""
    phase: str = ""
    """Where the larger peak falls: ``forward and backward`` or ``optimizer step``."""
    ranks: int = 1
    round_to: int = 1

    @property
    def peak(self) -> int:
        return max(self.first, self.later)

    def largest(self, n: int = 3) -> list[tuple[str, int]]:
        """The ``n`` largest parts, largest first."""
        return sorted(self.parts.items(), key=lambda kv: -kv[1])[:n]

    def summary(self) -> str:
        """``1.23 GiB (first step 1.23, later steps 1.20; at the peak: gradients 0.50, ...)``."""
        parts = ", ".join(f"{k} {gib(v)}" for k, v in self.largest(len(self.parts)))
        return (
            f"{gib(self.peak)} GiB on rank 0 (first step {gib(self.first)}, later steps {gib(self.later)}; "
            f"at the peak, in the {self.phase}: {parts})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "peak": self.peak,
            "first_step": self.first,
            "later_steps": self.later,
            "parts": self.parts,
            "phase": self.phase,
            "ranks": self.ranks,
            "round_to": self.round_to,
        }


def gib(n: int) -> str:
    """Bytes as GiB with two decimals (one home for the figures the plan prints)."""
    return f"{n / 2**30:.2f}"


class NotPlanned(Exception):
    """A run the planner cannot plan (one line: why)."""


def _check_plannable(config: Any) -> None:
    if config.parallelism.pipeline_parallel_degree > 1:
        raise NotPlanned("pipeline parallelism is not planned yet")
    if dist.is_initialized():
        raise NotPlanned("a process group is already running in this process")


@contextlib.contextmanager
def _fake_group(world_size: int):
    forget_shardings()  # no DTensor result cached on an earlier plan's (equal) meshes, before or after
    fake_process_group(world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_shardings()


def _stand_in(
    config: Any, model_config: Any, model: torch.nn.Module, dims: ParallelDims, loss_fn
) -> SimpleNamespace:
    """What torchtitan's step methods read from a trainer."""
    typecheck = config.parallelism.spmd_backend == "spmd_types"
    return SimpleNamespace(
        model_parts=[model],
        loss_fn=loss_fn,
        train_context=get_spmd_context(  # as torchtitan's Trainer sets it up (TP's collectives follow it)
            parallel_dims=dims, spmd_typechecking=typecheck and config.debug.spmd_typechecking
        ),
        model_config=model_config,
        parallel_dims=dims,
        config=config,
        ntokens_seen=0,
    )


def _microbatches(config: Any, dims: ParallelDims) -> int:
    t = config.training
    dp = dims.dp_replicate * dims.dp_shard if dims.dp_enabled else 1
    steps = t.global_batch_size // (t.local_batch_size * dp) if t.global_batch_size > 0 else 1
    return max(1, min(steps, MICROBATCHES))


def _tag_step_state(count: LiveStorages, model: torch.nn.Module, optimizers) -> None:
    for p in model.parameters():
        if p.grad is not None:
            count.add(p.grad, "gradients")
    for opt in optimizers.optimizers:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    count.add(v, "optimizer states")


FAKE_REFUSALS = fake_refusals()
"""What an op raises on tensors with no values when it needs them."""


def _state_stand_ins(budget: StateBytes | None, ranks: int, optimizers) -> list[torch.Tensor]:
    """For an optimizer whose step cannot run without values: its states as ``optim.budget`` counts them (equal
    to the live states to the byte: tests/titan/runtime/test_budget_train.py), rank 0's share, as byte tensors;
    what its step makes beside them is not counted. The states it made before it stopped are dropped.

    Raises:
        NotPlanned: no byte model for this optimizer either.
    """
    if budget is None:
        raise NotPlanned("the optimizer's step needs values and it has no byte model (optim/budget.py)")
    for opt in optimizers.optimizers:
        opt.state.clear()
    own = (s for s in budget.nbytes if s not in ("params", "grads"))
    return [torch.empty(-(-budget.nbytes[s] // max(1, ranks)), dtype=torch.uint8) for s in own]


def _budget(config: Any, world_size: int) -> StateBytes | None:
    try:
        return planned(config, world_size)
    except ValueError:  # an optimizer without a byte model: its step has to run under the fake mode
        return None


def plan_peak(config: Any, world_size: int, device_type: str, model_of: Callable[[Any], Any]) -> PeakPlan:
    """Rank 0's planned peak of ``config`` (as the launcher resolved it: ``worker.build_config``) on
    ``world_size`` ranks whose tensors live on ``device_type``; ``model_of(config)`` is the model config as the
    trainer holds it (``validate.model_as_trained``: ``max_seq_len`` from ``training.seq_len``, RoPE's
    table sized by it).

    Raises:
        NotPlanned: a run the planner does not plan (pipeline parallelism), or a process group is running.
    """
    _check_plannable(config)
    round_to = 512 if device_type == "cuda" else 1
    compiled = copy.deepcopy(config.compile)  # torchtitan's, as inductor runs it: peak_compile.py
    count = peak_compile.CompiledCount(round_to) if compiled.enable else LiveStorages(round_to)
    count.staging = None if device_type == "cuda" else gloo_staging  # NCCL's collectives stage nothing
    if compiled.enable:
        compiled.backend = peak_compile.backend(count)
        torch._dynamo.reset()  # each plan compiles anew (a fit plans many): never past dynamo's recompile limit
    with _fake_group(world_size), tempfile.TemporaryDirectory(prefix="lbt-peak-") as scratch:
        dims = ParallelDims.from_config(config.parallelism, world_size)
        dims.build_mesh()  # before the fake mode: the meshes read their ranks from real tensors
        dims.get_all_one_dimensional_meshes()
        budget = _budget(config, world_size)  # before the count: it builds the model on meta
        with fake_tensor_mode():
            peaks = _two_steps(config, model_of(config), dims, scratch, compiled, count, budget)
    (first, first_parts, first_phase), (later, later_parts, later_phase) = peaks
    parts, phase = (first_parts, first_phase) if first >= later else (later_parts, later_phase)
    ordered = {p: parts[p] for p in PARTS if parts.get(p)}
    return PeakPlan(first, later, ordered, phase, world_size, count.round_to)


def _workspace(count: LiveStorages, planned: dict, p: torch.Tensor) -> None:
    count.transient(planned[p], "optimizer step")


def _two_steps(
    config: Any,
    model_config: Any,
    dims: ParallelDims,
    scratch: str,
    compiled: Any,
    count: LiveStorages,
    budget: StateBytes | None,
) -> list:
    """Build the run on fake tensors and count two steps: [(peak, parts, phase)] of each."""
    t = config.training
    spec = config.model_spec
    with (
        torch.device("meta"),
        set_default_dtype(TORCH_DTYPE_MAP[t.dtype]),
    ):  # as torchtitan's Trainer builds it
        model = model_config.build()
    with titan_compile_backend(compiled.backend) if compiled.enable else contextlib.nullcontext():
        model = spec.parallelize_fn(
            model,
            parallel_dims=dims,
            training=t,
            parallelism=config.parallelism,
            compile_config=compiled,
            ac_config=config.activation_checkpoint,
            dump_folder=scratch,
        )
    model.to_empty(device="cpu")
    model.train()
    optimizers = config.optimizer.build(model_parts=[model])
    loss_fn = config.loss.build(compile_config=compiled)
    if isinstance(loss_fn, ChunkedLossWrapper):  # as the trainer sets it up
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    trainer = _stand_in(config, model_config, model, dims, loss_fn)
    for p in model.parameters():
        count.add(p, "parameters")
    for b in model.buffers():
        count.add(b, "buffers")
    shape = (t.local_batch_size, t.seq_len)
    tokens = torch.zeros(shape, dtype=torch.long)
    positions = torch.arange(t.seq_len).repeat(t.local_batch_size, 1)
    valid = torch.tensor(float(t.local_batch_size * t.seq_len))
    peaks, stand_ins = [], []
    in_backward = [o for o in optimizers.optimizers if getattr(o, "updates_in_backward", False)]
    # each hook counts its update's workspace (measured here, before the count) and frees the gradient
    for opt in in_backward:
        groups = [g for g in opt.param_groups if opt.options(g).in_backward]
        ws = {p: update_workspace(opt, p, g) for g in groups for p in g["params"]}
        opt.in_backward_stand_in = functools.partial(_workspace, count, ws)
    with count:
        for _ in range(2):
            count.phase = "forward and backward"
            # at the step's start, as torchtitan's train_step: a later step begins with the last one's gradients
            optimizers.zero_grad(set_to_none=t.disable_cuda_graphs)
            for _ in range(_microbatches(config, dims)):
                inputs, labels, extra = Trainer.post_dataloading_process(
                    trainer, {"input": tokens, "positions": positions}, tokens.clone()
                )
                forward_backward_body(trainer, inputs, labels, valid, extra)
                _tag_step_state(count, model, optimizers)
            count.phase = "optimizer step"
            if not stand_ins and in_backward:  # the hooks freed the gradients; states as the budget has them
                stand_ins.extend(_state_stand_ins(budget, dims.world_size, optimizers))
            elif not stand_ins:
                try:
                    optimizers.step()
                except FAKE_REFUSALS:  # an update that reads values (our low-bit optimizers' step counter)
                    stand_ins.extend(_state_stand_ins(budget, dims.world_size, optimizers))
            _tag_step_state(count, model, optimizers)
            for t_ in stand_ins:
                count.add(t_, "optimizer states")
            peaks.append((count.peak, count.parts(), count.peak_phase))
            count.reset_peak()
    return peaks
