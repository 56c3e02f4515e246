"""Compiled runs planned as inductor runs them (docs/memory.md, "Peak memory"; used by ``titan/runtime/peak.py``).

torch.compile makes a run hold less than its eager step: inductor's partitioner saves fewer activations for
the backward (it recomputes cheap pointwise ops), and a fused kernel never writes its intermediates to memory.
The planner builds a compiled run with torchtitan's own ``apply_compile`` and the run's compile components,
but with ``backend``: it splits each graph into forward and backward exactly as inductor does
(``compat.partitioned_backend``: inductor's decompositions and min-cut partitioner, so the same tensors are
saved) and runs the two graphs node by node under the count, where an op's output that inductor would keep
inside a fused kernel (``fused_away``) is counted as no bytes. Inductor's schedule (one kernel writing several
outputs, buffers freed after it) can hold more inside a graph than its node-by-node run: each graph is also
compiled by inductor (``compat.inductor_code``) and its generated code read (``code_peak``), and the count
reaches at least that peak above the graph's start. ``CompiledCount`` lets dynamo compile under the count (it is
switched off while dynamo traces and on while the graphs run).

Approximated: inductor's fusion for what a graph keeps (a pointwise op whose every use is another pointwise op
or a reduction is fused into it; inductor may also materialize such an op when its body grows large), and the
code read is inductor's for the CPU (the planner's fake tensors live there; Triton's kernels on a GPU may fuse
otherwise).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from low_bits_training.optim.memory import LiveStorages
from low_bits_training.titan.platform.compat import inductor_code, partitioned_backend

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


_ALLOC = re.compile(r"(buf\d+) = empty_strided_\w+\((\(.*?\)), (\(.*?\)), torch\.(\w+)\)")
_FALLBACK = re.compile(r"assert_tensor_metadata\((buf\d+), (\(.*?\)), (\(.*?\)), torch\.(\w+), '([\w.]+)'")
_RENAME = re.compile(r"(buf\d+) = (?:reinterpret_tensor\()?(buf\d+)\b.*; del (buf\d+)")
_FREE = re.compile(r"del (buf\d+)$")


def _extent(shape: str, stride: str, dtype: str) -> int:
    """Bytes of the storage a tensor of ``shape`` / ``stride`` spans (inductor's ``empty_strided``)."""
    sizes, steps = ast.literal_eval(shape), ast.literal_eval(stride)
    if not all(sizes):
        return 0
    elements = 1 + sum((n - 1) * step for n, step in zip(sizes, steps, strict=True))
    return elements * getattr(torch, dtype).itemsize


def code_peak(code: str) -> int:
    """The most bytes the graph inductor generated as ``code`` (``compat.inductor_code``) holds at once above
    its inputs while it runs: each buffer from its allocation (``empty_strided``, or a fallback op's output,
    which the code checks with ``assert_tensor_metadata``) to its ``del``, a reused buffer counted once, the
    graph's outputs to the end. The inputs are counted as held throughout (the caller's, and the saved
    activations a backward reads stay alive through it)."""
    body = code[code.index("def call(self, args)") :]
    live: dict[str, int] = {}
    now = peak = 0
    for line in body.splitlines():
        line = line.strip()
        if line.startswith("return "):
            break
        made = _ALLOC.match(line) or _FALLBACK.match(line)
        if made and made.group(1) not in live and not _is_view(made.groups()[4:]):
            live[made.group(1)] = _extent(*made.group(2, 3, 4))
            now += live[made.group(1)]
        elif (renamed := _RENAME.match(line)) and renamed.group(2) in live:
            live[renamed.group(1)] = live.pop(renamed.group(2))
        elif (freed := _FREE.match(line)) and freed.group(1) in live:
            now -= live.pop(freed.group(1))
        peak = max(peak, now)
    return peak


def _is_view(op: tuple) -> bool:
    """Whether a fallback op (``torch.ops.<namespace>.<name>.<overload>``) returns a view of an input."""
    if not op:
        return False
    namespace, name, overload = op[0].split(".")[-3:]
    found = getattr(getattr(getattr(torch.ops, namespace, None), name, None), overload, None)
    # an op not found here counts as a new buffer: the plan never holds fewer bytes for not knowing it
    return bool(getattr(found, "is_view", False))


def backend(count: CompiledCount) -> Callable:
    """The dynamo backend the planner compiles a run's modules with, counting into ``count``: each graph runs
    node by node, and at its end the count reaches at least what inductor's own code of the graph holds at its
    peak (``code_peak``: inductor fuses several outputs into one kernel and frees buffers after it, which a
    node-by-node run cannot see)."""

    def run(gm: torch.fx.GraphModule, example_inputs: list, is_backward: bool) -> Callable[[list], Any]:
        graph = _Counted(gm, count)
        above = code_peak(inductor_code(gm, example_inputs, is_backward))

        def call(args: list) -> Any:
            start = count.now
            try:
                return graph.boxed_run(args)
            finally:
                graph.env = {}  # the interpreter keeps the values at its output: let the caller hold them alone
                if start + above > count.now:
                    count.transient(start + above - count.now, count.phase)

        return call

    return partitioned_backend(run)
