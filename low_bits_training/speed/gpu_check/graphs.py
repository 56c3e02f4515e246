"""CUDA-graph replay of a quantized transformer block against the eager step: stochastic rounding on, and
the plan switched between steps, outside the graph (what the autopilot does; it turns graphs off for the
run, ``titan.runtime.graphs.graph_blockers``, because a captured step keeps its casts).

The block is ``block.Block`` at a small shape, every linear our ``QuantLinear`` emulation. Attention runs
SDPA's math kernel here: flash attention's backward sums dQ with atomics, so two runs of it may differ in
the last bit whether or not a graph replays them.
"""

from __future__ import annotations

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from low_bits_training.nn import LinearPlan, QuantLinear, rng

from .block import Block, BlockShape
from .catalog import RECIPES
from .parity import per_recipe, row

GRAPH_BLOCK = BlockShape(dim=1024, n_heads=8, n_kv_heads=2, ffn=2048, tokens=512)
"""The block of the check: every block and tile size of the recipes divides its dimensions."""
SWITCH_TO = "fp8_rowwise"
"""The plan the block switches to between graph captures."""


def quant_block(plan: LinearPlan, device: torch.device) -> Block:
    """``Block`` of ``GRAPH_BLOCK`` with every linear a bf16 ``QuantLinear`` of ``plan``."""

    def linear(k: int, n: int) -> QuantLinear:
        return QuantLinear(k, n, bias=False, plan=plan, device=device, dtype=torch.bfloat16)

    return Block(GRAPH_BLOCK, linear).to(device, torch.bfloat16)


def set_plan(block: Block, plan: LinearPlan) -> None:
    """Switch every QuantLinear of ``block`` to ``plan`` (between steps, never inside a graph)."""
    for m in block.modules():
        if isinstance(m, QuantLinear):
            m.plan = plan


def _outputs(block: Block, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    return [y, x.grad, *(p.grad for p in block.parameters())]  # (y, dx, every dW)


def _zero(block: Block, x: torch.Tensor) -> None:
    x.grad = None
    block.zero_grad(set_to_none=True)


def eager_step(block: Block, x, dy, key: int) -> list[torch.Tensor]:
    """One forward + backward under step key ``key`` from no gradients; copies of its outputs."""
    _zero(block, x)
    rng.set_step_key(key)
    y = block(x)
    y.backward(dy)
    return [t.detach().clone() for t in _outputs(block, x, y)]


def capture(block: Block, x, dy) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """Warm up on a side stream (torch's capture recipe), then capture one step under key 1 with no
    gradients held, so the captured backward assigns them (a replay rewrites them).

    Returns:
        The graph and its static outputs (y, dx, every dW), which each replay overwrites.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        eager_step(block, x, dy, 1)
    torch.cuda.current_stream().wait_stream(side)
    _zero(block, x)
    graph = torch.cuda.CUDAGraph()
    rng.set_step_key(1)
    with torch.cuda.graph(graph):
        y = block(x)
        y.backward(dy)
    return graph, _outputs(block, x, y)


def replay(graph: torch.cuda.CUDAGraph, static: list[torch.Tensor], key: int) -> list[torch.Tensor]:
    """Replay under step key ``key`` (filled in place: the graph reads it); copies of its outputs."""
    rng.set_step_key(key)
    graph.replay()
    torch.cuda.synchronize()
    return [t.detach().clone() for t in static]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


def graph_check(recipe: str) -> dict:
    """The captured step replayed under a new key equals the eager step under it (a replay that reused a
    captured host value would repeat the capture's stochastic rounding); after a switch to ``SWITCH_TO``
    the old graph still replays the old casts, and a graph captured after it equals the new eager step."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    plan = LinearPlan.from_recipe(recipe)
    block = quant_block(plan, dev)
    x = torch.randn(GRAPH_BLOCK.tokens, GRAPH_BLOCK.dim, device=dev, dtype=torch.bfloat16, generator=g)
    x.requires_grad_()
    dy = torch.randn(GRAPH_BLOCK.tokens, GRAPH_BLOCK.dim, device=dev, dtype=torch.bfloat16, generator=g)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            eager = eager_step(block, x, dy, 2)
            graph, static = capture(block, x, dy)
            same = _equal(replay(graph, static, 2), eager)
            set_plan(block, LinearPlan.from_recipe(SWITCH_TO))
            switched = eager_step(block, x, dy, 2)
            stale = torch.equal(replay(graph, static, 2)[0], switched[0])
            graph2, static2 = capture(block, x, dy)
            fresh = _equal(replay(graph2, static2, 2), switched)
    finally:
        rng.set_step_key(None)
    sr = any(s is not None and s.rounding == "stochastic" for s in plan.specs)
    ok = same and fresh and stale == (recipe == SWITCH_TO)
    detail = (f"stochastic rounding {'on' if sr else 'off'}; replay == eager (y, dx, every dW): {same}; after a "
              f"switch to {SWITCH_TO} outside the graph the old graph replays the old casts: {not stale}, a "
              f"recaptured graph == eager: {fresh}")  # fmt: skip
    return row("ok" if ok else "fail", detail, recipe=recipe, summary={"CUDA graph": "ok" if ok else "FAIL"})


def graph_rows(ctx) -> list[dict]:
    """``graph_check`` for every quantized summary recipe."""
    return per_recipe(graph_check, [r for r in RECIPES if r != "bf16"])
