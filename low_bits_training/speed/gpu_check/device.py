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


ACCUMULATE_BOUND = 32.0
"""The most a GEMM summing in fp32 may err, per element, in units of u x sum_k |a_k b_k| (u = 2**-24).
``benchmarks/gemm_accumulation.py`` measures it (docs/speed_model.md, "The GPU check"): on an H200 the bf16
tensor-core GEMM with an fp32 result errs up to ~7 (K = 2048 and 8192), with or without
``allow_bf16_reduced_precision_reduction``, as TF32 does; fp32 SGEMMs and the CPU's GEMMs 0.2-2.2; a bf16
result thousands. The tensor cores' fp32 sum is not rounded to nearest, so the first run's "within 2x the
fp32 GEMM" failed there (2026-11-28); this bound still refuses a bf16 sum or result."""


def error_units(got: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each element's signed error of ``got`` (a GEMM of ``a @ b``) against the float64 product, in units of
    u x sum_k |a_k b_k| (u = 2**-24), on the CPU (``benchmarks/gemm_accumulation.py`` prints these too)."""
    a, b = a.double().cpu(), b.double().cpu()
    return (got.double().cpu() - a @ b) / ((a.abs() @ b.abs()) * 2.0**-24)


def accumulate_rows(ctx) -> list[dict]:
    """``nn.kernels.mm_fp32_accumulate`` (and, on CUDA, ``tensor_core_mm`` itself) against the float64
    product of bf16-valued operands: fp32 accumulation, within ``ACCUMULATE_BOUND`` units of
    u x sum_k |a_k b_k| per element; the fp32 GEMM's error in the same units beside it."""

    g = torch.Generator().manual_seed(0)
    a = torch.randn(512, 2048, generator=g).bfloat16().float().to(ctx.device)
    b = torch.randn(2048, 512, generator=g).bfloat16().float().to(ctx.device)
    exact = a.double() @ b.double()
    fp32 = error_units(torch.mm(a, b), a, b).abs().max().item()
    fns = {"mm_fp32_accumulate": mm_fp32_accumulate} | (
        {"tensor_core_mm": tensor_core_mm} if ctx.device == "cuda" else {}
    )
    out = []
    for name, fn in fns.items():
        got = fn(a, b)
        err, max_error = error_units(got, a, b).abs().max().item(), (got.double() - exact).abs().max().item()
        ok = err <= ACCUMULATE_BOUND
        detail = (f"{ctx.device}: max error {err:.2f} u x sum|ab| (<= {ACCUMULATE_BOUND:g}: an fp32 sum; "
                  f"fp32 GEMM {fp32:.2f}), {max_error:.3g} absolute")  # fmt: skip
        out.append(row("ok" if ok else "fail", detail, case=name, max_error=max_error, error_units=err,
                       fp32_error_units=fp32))  # fmt: skip
    return out
