"""Compiled runs planned as inductor runs them (docs/memory.md, "Peak memory"; used by ``titan/runtime/peak.py``).

torch.compile makes a run hold less than its eager step: inductor's partitioner saves fewer activations for
the backward (it recomputes cheap pointwise ops), and a fused kernel never writes its intermediates to memory.
The planner builds a compiled run with torchtitan's own ``apply_compile`` and the run's compile components,
but with ``backend``: it splits each graph into forward and backward exactly as inductor does
(``compat.partitioned_backend``: inductor's decompositions and min-cut partitioner, so the same tensors are
saved) and runs the two graphs node by node under the count, where an op's output that inductor would keep
inside a fused kernel (``fused_away``) is counted as no bytes. ``CompiledCount`` lets dynamo compile under the
count (it is switched off while dynamo traces and on while the graphs run).

Approximated: inductor's fusion (a pointwise op whose every use is another pointwise op or a reduction is
fused into it; inductor may also materialize such an op when its body grows large), its buffer reuse beyond
freeing each buffer after its last use, and the graphs' order (run as the partitioner leaves it; inductor's
scheduler may reorder).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from low_bits_training.optim.memory import LiveStorages
from low_bits_training.titan.platform.compat import partitioned_backend

FUSIBLE = (torch.Tag.pointwise, torch.Tag.reduction)
"""The ops inductor fuses a pointwise producer into (a kernel that reads the value where it is made)."""


class CompiledCount(LiveStorages):
    """``LiveStorages`` under which torch.compile compiles: dynamo traces with the count off and runs the
    compiled graphs with it on; while ``fused`` is set, new storages count no bytes."""

    def __init__(self, round_to: int = 1):
        super().__init__(round_to)
        self.fused = False

    def ignore_compile_internals(self) -> bool:
        return True

    def _bytes(self, n: int) -> int:
        return 0 if self.fused else super()._bytes(n)


def _op(node: torch.fx.Node) -> Any:
    """The aten / prims / custom op a node calls (its ``tags`` and ``is_view``), else None."""
    target = node.target
    return (
        target
        if node.op == "call_function" and hasattr(target, "tags") and hasattr(target, "is_view")
        else None
    )


def _complex(node: torch.fx.Node) -> bool:
    """Whether ``node`` makes or reads a complex tensor (inductor has no complex code: it calls aten's op)."""
    vals = [node.meta.get("val")] + [a.meta.get("val") for a in node.all_input_nodes]
    return any(isinstance(v, torch.Tensor) and v.is_complex() for v in vals)


def _fusible(node: torch.fx.Node, tags: tuple = FUSIBLE) -> bool:
    op = _op(node)
    return op is not None and any(tag in op.tags for tag in tags) and not _complex(node)


def _written(node: torch.fx.Node) -> bool:
    """Whether ``node``'s value has to be in memory: a use (through views) is the graph's output or an op that
    is not fused with its producer (a matmul, attention, a custom op, a complex op, a copy into an input)."""
    for user in node.users:
        op = _op(user)
        if op is not None and op.is_view:
            if _written(user):
                return True
        elif not _fusible(user):
            return True
    return False


def fused_away(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The pointwise nodes of ``graph`` whose values inductor keeps inside a fused kernel."""
    return {n for n in graph.nodes if _fusible(n, (torch.Tag.pointwise,)) and not _written(n)}


class _Counted(torch.fx.Interpreter):
    """Runs a graph node by node (each value freed after its last use), counting no bytes for fused nodes."""

    def __init__(self, gm: torch.fx.GraphModule, count: CompiledCount):
        super().__init__(gm)
        self.count = count
        self.fused = fused_away(gm.graph)

    def run_node(self, n: torch.fx.Node) -> Any:
        if n not in self.fused:
            return super().run_node(n)
        self.count.fused = True
        try:
            return super().run_node(n)
        finally:
            self.count.fused = False


def backend(count: CompiledCount) -> Callable:
    """The dynamo backend the planner compiles a run's modules with, counting into ``count``."""

    def run(gm: torch.fx.GraphModule) -> Callable[[list], Any]:
        graph = _Counted(gm, count)

        def call(args: list) -> Any:
            try:
                return graph.boxed_run(args)
            finally:
                graph.env = {}  # the interpreter keeps the values at its output: let the caller hold them alone

        return call

    return partitioned_backend(run)
