"""Checks of what this device runs: which backend takes each layer kind per recipe (``config.backends``),
CUDA-graph replay of a quantized layer against eager (stochastic rounding on, the plan switched outside the
graph), the fp32-accumulate GEMM against float64."""

from __future__ import annotations

import torch

from low_bits_training.nn import LinearPlan, QuantLinear, rng

from .catalog import RECIPES
from .parity import per_recipe, row

LINEAR = (4096, 14336)
"""(in, out) features the backend rows ask about: Llama 3 8B's FFN up projection."""
GRAPH_SIZE = 1024
"""Rows and features of the CUDA-graph check's layer."""
SWITCH_TO = "fp8_rowwise"
"""The plan a layer switches to between graph captures (what the autopilot does between steps)."""


def backend_rows(ctx) -> list[dict]:
    """Per summary recipe: the backend of each GEMM of a linear layer and of an MoE expert weight on this
    hardware under ``backend = "auto"``, and why a layer does not get torchao's kernel."""
    from low_bits_training.config.backends import detect_hardware, fallback_reason, layer_backends
    from low_bits_training.config.plan import LayerShape

    hw, out = detect_hardware(), []
    for recipe in RECIPES:
        plan = LinearPlan.from_recipe(recipe)
        lin = layer_backends(plan, "auto", hw, *LINEAR)
        experts = layer_backends(plan, "auto", hw, *LINEAR, grouped=True)
        why = fallback_reason(plan, LayerShape(*LINEAR), hw, "auto")
        names = [("high" if plan.is_high_precision else b) for b in (lin[0], experts[0])]
        cell = f"linear {names[0]}, experts {names[1]}, attention products bf16" + (
            f" ({why})" if why else ""
        )
        out.append(row("info", f"{hw}: {cell}", recipe=recipe, linear=list(lin), experts=list(experts),
                       fallback=why, summary={"backends": cell}))  # fmt: skip
    return out


def accumulate_rows(ctx) -> list[dict]:
    """``nn.kernels.mm_fp32_accumulate`` (and, on CUDA, ``tensor_core_mm`` itself) against the float64
    product of bf16-valued operands: an error no larger than twice the fp32 GEMM's (both sum in fp32)."""
    from low_bits_training.nn.kernels import mm_fp32_accumulate, tensor_core_mm

    g = torch.Generator().manual_seed(0)
    a = torch.randn(512, 2048, generator=g).bfloat16().float().to(ctx.device)
    b = torch.randn(2048, 512, generator=g).bfloat16().float().to(ctx.device)
    exact = a.double() @ b.double()
    fp32 = (torch.mm(a, b).double() - exact).abs().max().item()
    fns = {"mm_fp32_accumulate": mm_fp32_accumulate} | (
        {"tensor_core_mm": tensor_core_mm} if ctx.device == "cuda" else {}
    )
    out = []
    for name, fn in fns.items():
        err = (fn(a, b).double() - exact).abs().max().item()
        ok = err <= 2 * fp32 + 1e-6
        out.append(row("ok" if ok else "fail", f"{ctx.device}: max error {err:.3g} (fp32 GEMM {fp32:.3g})",
                       case=name, max_error=err, fp32_error=fp32))  # fmt: skip
    return out


def _step(layer, x, dy, key: int):
    rng.set_step_key(key)
    y = layer(x)
    y.backward(dy)
    return y.detach().clone(), x.grad.clone(), layer.weight.grad.clone()


def _zero(layer, x) -> None:
    x.grad = layer.weight.grad = None


def _capture(layer, x, dy) -> tuple[torch.cuda.CUDAGraph, tuple]:
    """Warm up on a side stream (torch's capture recipe), then capture one step under key 1 with no
    gradients held, so the captured backward assigns them (a replay rewrites them, never accumulates).

    Returns:
        The graph and its static outputs (y, dx, dW), which every replay overwrites.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _step(layer, x, dy, 1)
    torch.cuda.current_stream().wait_stream(side)
    _zero(layer, x)
    graph = torch.cuda.CUDAGraph()
    rng.set_step_key(1)
    with torch.cuda.graph(graph):
        y = layer(x)
        y.backward(dy)
    return graph, (y, x.grad, layer.weight.grad)


def _replay(graph, static: tuple, key: int) -> list[torch.Tensor]:
    rng.set_step_key(key)  # filled in place: the captured graph reads the new key
    graph.replay()
    torch.cuda.synchronize()
    return [t.detach().clone() for t in static]


def graph_check(recipe: str) -> dict:
    """One step of ``recipe`` captured in a CUDA graph and replayed under a new step key equals the eager
    step under that key (a replay that reused a captured host value would repeat the capture's stochastic
    rounding); then the plan switches outside the graph: the old graph still replays the old casts (so a
    switch inside a captured step would be lost: the autopilot turns graphs off, ``graph_blockers``) and a
    graph captured after the switch equals the eager step of the new plan."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    layer = QuantLinear(GRAPH_SIZE, GRAPH_SIZE, bias=False, plan=LinearPlan.from_recipe(recipe), device=dev,
                        dtype=torch.bfloat16)  # fmt: skip
    x = torch.randn(GRAPH_SIZE, GRAPH_SIZE, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    dy = torch.randn(GRAPH_SIZE, GRAPH_SIZE, device=dev, dtype=torch.bfloat16, generator=g)
    try:
        eager = _step(layer, x, dy, 2)
        _zero(layer, x)
        graph, captured = _capture(layer, x, dy)
        same = [torch.equal(a, b) for a, b in zip(_replay(graph, captured, 2), eager, strict=True)]
        layer.plan = LinearPlan.from_recipe(SWITCH_TO)  # the switch, between steps, outside any graph
        _zero(layer, x)
        switched = _step(layer, x, dy, 2)
        stale = torch.equal(_replay(graph, captured, 2)[0], switched[0])
        _zero(layer, x)
        graph2, captured2 = _capture(layer, x, dy)
        fresh = all(torch.equal(a, b) for a, b in zip(_replay(graph2, captured2, 2), switched, strict=True))
    finally:
        rng.set_step_key(None)
    ok = all(same) and fresh and (stale == (recipe == SWITCH_TO))
    detail = (f"replay == eager (y, dx, dW): {same}; after a switch to {SWITCH_TO} outside the graph: old graph "
              f"{'still' if not stale else 'also'} {'replays the old casts' if not stale else 'matches'}, "
              f"recaptured graph == eager: {fresh}")  # fmt: skip
    return row("ok" if ok else "fail", detail, recipe=recipe, summary={"CUDA graph": "ok" if ok else "FAIL"})


def graph_rows(ctx) -> list[dict]:
    """``graph_check`` for every quantized summary recipe."""
    return per_recipe(graph_check, [r for r in RECIPES if r != "bf16"])
