"""The checks ``scripts/gpu_check.sh`` runs on a CUDA device (levels 1 and 2), each a function returning a
result row; ``scripts/gpu_check.py`` lists, runs and reports them.

Level 1 (torch only): every format's cast and every recipe's QuantLinear (forward and both backward GEMMs)
on CUDA against the CPU; the real fp8 GEMM (``torch._scaled_mm``, tensorwise and rowwise) against the
emulation; linear-layer speed per recipe against bf16, next to the speed model's prediction for this GPU.
Level 2 (torchao): torchao's modules for the plans they compute, against our emulation, and their speed.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from low_bits_training.formats import FORMATS, QuantSpec, fake_quantize
from low_bits_training.nn import QuantLinear, rng
from low_bits_training.nn.recipes import RECIPES
from low_bits_training.nn.roles import ROLES, LinearPlan

from .gpus import GpuSpec, gpu_for_device
from .model import GemmTarget
from .predict import predict

CAST_ROUNDINGS = ("nearest", "stochastic")
SCALE_ONLY = ("e8m0", "ue4m3")
"""Scale formats: cast with scaling "none" on positive values."""
PARITY_SHAPE = (256, 512, 384)
"""(M, K, N) of the CPU / CUDA parity checks: every block and tile size of the recipes divides it."""
SPEED_SHAPES = ((8192, 4096, 4096), (8192, 4096, 14336))
"""(M, K, N) of the speed checks: Llama 3 8B's attention output and FFN up projections at 8192 tokens."""
SPEED_RECIPES = ("fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_hp_wgrad", "deepseek_fp8", "mxfp8", "nvfp4")
REAL_RECIPES = ("fp8_tensorwise", "fp8_rowwise")
"""Recipes whose GEMMs ``torch._scaled_mm`` runs (the "real" backend, ``nn.kernels``)."""


def row(level: int, item: str, status: str, detail: str = "", **numbers) -> dict:
    """One result: level, item, status ("ok" | "fail" | "skip"), what was seen, and its numbers."""
    return {"level": level, "item": item, "status": status, "detail": detail, **numbers}


def level1_items() -> list[str]:
    """Every level-1 item, by name (the dry run lists them)."""
    casts = [f"cast {f} {r}" for f in FORMATS for r in CAST_ROUNDINGS]
    parity = [f"QuantLinear cuda == cpu: {r}" for r in RECIPES if r != "bf16"]
    real = [f"_scaled_mm vs emulation: {r}" for r in REAL_RECIPES]
    speed = [f"speed {r} {m}x{k}x{n}" for r in SPEED_RECIPES for m, k, n in SPEED_SHAPES]
    return casts + parity + real + speed


def level2_items() -> list[str]:
    """Every level-2 item: torchao's module for each recipe torchao computes."""
    from low_bits_training.nn.torchao_modules import torchao_recipe

    names = [r for r in RECIPES if r != "bf16" and torchao_recipe(LinearPlan.from_recipe(r)) is not None]
    return [f"torchao vs emulation: {r}" for r in names] + [f"torchao speed {r}" for r in names]


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other is NaN (payloads aside)."""
    a, b = a.detach().cpu().float(), b.detach().cpu().float()
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan]))


def cast_parity(fmt: str, rounding: str, devices: tuple[str, str] = ("cpu", "cuda")) -> dict:
    """One format's cast on CUDA against the CPU, bit for bit (stochastic rounding from the same key)."""
    scaling = "none" if fmt in SCALE_ONLY or fmt in ("fp32", "bf16", "fp16") else "tensor"
    spec = QuantSpec(fmt, scaling, rounding=rounding)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    x = x.abs() + 1e-3 if fmt in SCALE_ONLY else x
    outs = [fake_quantize(x.to(d), spec, torch.tensor(1234, device=d)) for d in devices]
    ok = bits_equal(*outs)
    return row(1, f"cast {fmt} {rounding}", "ok" if ok else "fail", "bit for bit" if ok else "differs")


def _fwd_bwd(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    xg = x.detach().clone().requires_grad_()
    y = module(xg)
    y.backward(dy)
    return [y.detach(), xg.grad, module.weight.grad]


def _operands(device: str, dtype=torch.float32) -> tuple[torch.nn.Linear, torch.Tensor, torch.Tensor]:
    m, k, n = PARITY_SHAPE
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
    x, dy = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g) * 1e-3
    return lin.to(device, dtype), x.to(device, dtype), dy.to(device, dtype)


def recipe_parity(recipe: str, devices: tuple[str, str] = ("cpu", "cuda")) -> dict:
    """A recipe's casts bit for bit on CUDA and CPU; its three GEMM outputs equal up to fp32 summation order
    (the emulation's matmul sums in cuBLAS's order on the GPU, oneDNN's on the CPU)."""
    plan = LinearPlan.from_recipe(recipe)
    runs = []
    rng.set_step_key(12345)  # counter-based SR bits (nn.rng): the same on every device
    try:
        for device in devices:
            lin, x, dy = _operands(device)
            tensors = _role_tensors(plan, lin, x, dy)
            casts = [fake_quantize(t, s, torch.tensor(7, device=device)) for t, s in tensors]
            runs.append((casts, _fwd_bwd(QuantLinear.from_linear(lin, plan), x, dy)))
    finally:
        rng.set_step_key(None)
    (c_cpu, o_cpu), (c_gpu, o_gpu) = runs
    casts_ok = all(bits_equal(a, b) for a, b in zip(c_cpu, c_gpu, strict=True))
    rel = max(_rel(a, b) for a, b in zip(o_cpu, o_gpu, strict=True))
    ok = casts_ok and rel <= 1e-5
    detail = f"casts {'bit for bit' if casts_ok else 'DIFFER'}; GEMM outputs max rel diff {rel:.1e}"
    return row(1, f"QuantLinear cuda == cpu: {recipe}", "ok" if ok else "fail", detail, max_rel_diff=rel)


def _role_tensors(plan: LinearPlan, lin, x, dy) -> list[tuple[torch.Tensor, QuantSpec]]:
    tensors = {"input": x, "weight": lin.weight.detach(), "grad_output": dy}
    out = []
    for role, spec in zip(ROLES, plan.specs, strict=True):
        if spec is not None:
            t = tensors[role.operand]
            out.append((t if role.axis == -1 else t.t().contiguous(), dataclasses.replace(spec, axis=-1)))
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def real_vs_emulation(recipe: str, device: str = "cuda") -> dict:
    """``torch._scaled_mm`` (our "real" backend) against the emulation on CUDA, bf16 inputs: one bf16 ulp."""
    plan = LinearPlan.from_recipe(recipe)
    lin, x, dy = _operands(device, torch.bfloat16)
    outs = [_fwd_bwd(QuantLinear.from_linear(copy.deepcopy(lin), p), x, dy) for p in (plan, _real(plan))]
    rel = max(_rel(a, b) for a, b in zip(*outs, strict=True))
    status = "ok" if rel <= 2.0**-7 else "fail"
    return row(1, f"_scaled_mm vs emulation: {recipe}", status, f"max rel diff {rel:.1e}", max_rel_diff=rel)


def _real(plan: LinearPlan) -> LinearPlan:
    return LinearPlan(plan.specs, ("real",) * 3)


def time_ms(module: torch.nn.Module, x: torch.Tensor, iters: int = 10) -> float:
    """Median ms of forward + backward (CUDA events, after 3 warm-up runs)."""
    dy = torch.randn(x.shape[0], module.out_features, device=x.device, dtype=x.dtype)
    times = []
    for i in range(iters + 3):
        xi = x.detach().requires_grad_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        module(xi).backward(dy)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
        module.zero_grad(set_to_none=True)
    return sorted(times)[len(times) // 2]


def predicted_ratio(recipe: str, m: int, k: int, n: int, spec: GpuSpec | None) -> float | None:
    """The speed model's GEMM + cast speedup over bf16 of one linear on this GPU (None: unknown GPU)."""
    if spec is None:
        return None
    return predict([GemmTarget("linear", k, n, m, LinearPlan.from_recipe(recipe))], spec).gemm_speedup


def linear_speed(recipe: str, shape: tuple[int, int, int], level: int = 1, torchao: bool = False) -> dict:
    """fwd+bwd ms of one linear: bf16 nn.Linear, the recipe (our emulation, ``_scaled_mm`` where it runs
    the recipe, or torchao's module), and the model's predicted ratio for this GPU."""
    m, k, n = shape
    lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    plan = LinearPlan.from_recipe(recipe)
    if torchao:
        from low_bits_training.nn.torchao_modules import torchao_linear

        mod, what = torchao_linear(lin, plan, emulated=False), "torchao"
    else:
        mod, what = QuantLinear.from_linear(lin, _real(plan) if recipe in REAL_RECIPES else plan), "ours"
    bf16, ms = time_ms(torch.compile(lin), x), time_ms(torch.compile(mod), x)
    pred = predicted_ratio(recipe, m, k, n, gpu_for_device(torch.cuda.get_device_name(0)))
    name = f"{'torchao speed' if torchao else 'speed'} {recipe}" + ("" if torchao else f" {m}x{k}x{n}")
    detail = f"{what} {ms:.3f} ms vs bf16 {bf16:.3f} ms: x{bf16 / ms:.2f}; model x{pred:.2f}" if pred else ""
    return row(level, name, "ok", detail, ms=ms, bf16_ms=bf16, measured_ratio=bf16 / ms, predicted_ratio=pred)


def torchao_vs_emulation(recipe: str, device: str = "cuda", emulated: bool = False) -> dict:
    """torchao's module (its kernel; ``emulated``: its emulated mode) against our emulation of the same plan,
    bf16 inputs."""
    from low_bits_training.nn.torchao_modules import torchao_linear

    plan = LinearPlan.from_recipe(recipe)
    lin, x, dy = _operands(device, torch.bfloat16)
    ours = _fwd_bwd(QuantLinear.from_linear(copy.deepcopy(lin), plan), x, dy)
    theirs = _fwd_bwd(torchao_linear(copy.deepcopy(lin), plan, emulated=emulated), x, dy)
    rel = max(_rel(a, b) for a, b in zip(theirs, ours, strict=True))
    status = "ok" if rel <= 2.0**-6 else "fail"
    return row(2, f"torchao vs emulation: {recipe}", status, f"max rel diff {rel:.1e}", max_rel_diff=rel)
