"""Checks of what this device runs: which backend takes each layer kind per recipe (``plan.backends``),
and the fp32-accumulate GEMM against float64."""

from __future__ import annotations

import torch

from low_bits_training.nn import LinearPlan
from low_bits_training.nn.hardware import detect_hardware
from low_bits_training.nn.kernels import mm_fp32_accumulate, tensor_core_mm
from low_bits_training.plan.backends import fallback_reason, layer_backends
from low_bits_training.plan.resolve import LayerShape

from .catalog import RECIPES
from .parity import row

LINEAR = (4096, 14336)
"""(in, out) features the backend rows ask about: Llama 3 8B's FFN up projection."""


def backend_rows(ctx) -> list[dict]:
    """Per summary recipe: the backend of each GEMM of a linear layer and of an MoE expert weight on this
    hardware under ``backend = "auto"``, and why a layer does not get torchao's kernel."""

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
