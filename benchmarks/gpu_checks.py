"""The first GPU run's checks (issue 29), on the GPU at hand: what the CPU tests hold with simulated hardware.

    python benchmarks/gpu_checks.py            # also the first thing benchmarks/bench_gpu.py runs

Needs torch and this package only (torchtitan / torchao optional: their rows say "not installed"). One line
and exit code 2 without CUDA. Prints one markdown table, a row per check, and exits 1 when one fails:

- hardware: the GPU as ``config.backends.detect_hardware`` sees it (capability, torchao, Triton, the MXFP8
  CUDA dim-1 cast kernel);
- fallback, per recipe: the line ``config.backends.fallback_reason`` gives a 4096 x 4096 layer on this GPU
  under ``backend = "auto"`` ("torchao" where torchao's kernel runs it);
- CUDA graph, per recipe: a ``QuantLinear(1024, 1024)`` forward + backward, warmed up once, captured in a
  CUDA graph and replayed under a new step key, against the same step run eagerly: output and gradients equal
  bit for bit (a replay that reused a captured host value would repeat the warm-up's stochastic rounding);
- tensor-core GEMM: ``nn.kernels.mm_fp32_accumulate`` (a bf16 GEMM with an fp32 result on CUDA) against the
  float64 product of bf16-valued operands: its error no larger than the fp32 GEMM's (both accumulate in fp32);
- NaN guard: torchao's inductor min/max patch active after ``titan.platform.compat.guard_fp8_stores``.

Not run on a GPU by its author (none was lent when it was written): the first GPU session should run it and
record the table in docs/precision_plan.md ("The first GPU run").
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SIZE = 1024


def _hardware_row():
    from low_bits_training.config.backends import detect_hardware

    hw = detect_hardware()
    detail = f"{hw}, torchao {hw.torchao}, triton {hw.triton}, mxfp8 CUDA cast {hw.mxfp8_cuda_cast}"
    return hw, ("hardware", "info", detail)


def _fallback_rows(hw, recipes):
    from low_bits_training.config.backends import fallback_reason
    from low_bits_training.config.plan import LayerShape
    from low_bits_training.nn import LinearPlan

    out = []
    for recipe in recipes:
        plan = LinearPlan.from_recipe(recipe)
        why = fallback_reason(plan, LayerShape(4096, 4096, 8192), hw, "auto")
        out.append((f"fallback {recipe}", "info", why or "torchao"))
    return out


def _eager_step(layer, x, dy, key):
    from low_bits_training.nn import rng

    rng.set_step_key(key)
    y = layer(x)
    y.backward(dy)
    return y.detach().clone(), x.grad.clone(), layer.weight.grad.clone()


def _graph_row(recipe: str):
    """Capture one warm step of ``recipe`` in a CUDA graph, replay it under key 2, compare with eager key 2."""
    from low_bits_training.nn import LinearPlan, QuantLinear, rng

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    plan = LinearPlan.from_recipe(recipe)
    layer = QuantLinear(SIZE, SIZE, bias=False, plan=plan, device=dev, dtype=torch.bfloat16)
    x = torch.randn(SIZE, SIZE, device=dev, dtype=torch.bfloat16, generator=g).requires_grad_()
    dy = torch.randn(SIZE, SIZE, device=dev, dtype=torch.bfloat16, generator=g)
    try:
        eager = _eager_step(layer, x, dy, 2)
        x.grad = layer.weight.grad = None
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as torch's capture recipe asks
            _eager_step(layer, x, dy, 1)
        torch.cuda.current_stream().wait_stream(side)
        x.grad = layer.weight.grad = None
        graph = torch.cuda.CUDAGraph()
        rng.set_step_key(1)
        with torch.cuda.graph(graph):
            y = layer(x)
            y.backward(dy)
        rng.set_step_key(2)  # filled in place: the captured graph reads the new key
        x.grad.zero_()
        layer.weight.grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        got = (y.detach(), x.grad, layer.weight.grad)
    except Exception as e:  # a check's failure is its result: one line in the table, exit 1 at the end
        return (f"CUDA graph {recipe}", "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    finally:
        rng.set_step_key(None)
    same = [torch.equal(a, b) for a, b in zip(got, eager, strict=True)]
    detail = "replay == eager (y, dx, dW)" if all(same) else f"differs (y, dx, dW equal: {same})"
    return (f"CUDA graph {recipe}", "OK" if all(same) else "FAIL", detail)


def _tensor_core_row():
    from low_bits_training.nn.kernels import mm_fp32_accumulate

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(2048, 4096, device="cuda", generator=g).bfloat16().float()
    b = torch.randn(4096, 2048, device="cuda", generator=g).bfloat16().float()
    exact = a.double() @ b.double()
    ours = (mm_fp32_accumulate(a, b).double() - exact).abs().max().item()
    fp32 = (torch.mm(a, b).double() - exact).abs().max().item()
    ok = ours <= 2 * fp32 + 1e-6
    return ("tensor-core GEMM", "OK" if ok else "FAIL", f"max error {ours:.3g} (fp32 GEMM {fp32:.3g})")


def _guard_row():
    try:
        from low_bits_training.titan.platform import compat

        compat.guard_fp8_stores()
        on = compat.fp8_stores_guarded()
    except ImportError as e:
        return ("NaN guard", "info", f"not installed ({e.name})")
    return ("NaN guard", "OK" if on else "FAIL", "inductor's Triton min/max patched" if on else "not applied")


def main() -> int:
    if not torch.cuda.is_available():
        print(
            "gpu_checks: no CUDA device visible; these checks need a GPU (the CPU tests hold them simulated)"
        )
        return 2
    sys.path.insert(0, str(REPO))
    from low_bits_training.config.recipes import RECIPES

    recipes = [r for r, specs in RECIPES.items() if any(s is not None for s in specs.values())]
    hw, row = _hardware_row()
    rows = [row, *_fallback_rows(hw, recipes), *(_graph_row(r) for r in recipes), _tensor_core_row()]
    rows.append(_guard_row())
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}\n")
    print("| check | result | detail |\n|---|---|---|")
    for name, status, detail in rows:
        print(f"| {name} | {status} | {detail} |")
    return 1 if any(status == "FAIL" for _, status, _ in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
