"""Numerics checks: CUDA against the CPU (casts bit for bit, GEMMs up to summation order), the emulation
against ``torch._scaled_mm`` (bit for bit where the math allows, a stated tolerance where it does not), and
against torchao's modules (a tolerance, each row says why).

What is exactly comparable: a cast (our fp8 values against the same values cast again by ``torch``), and an
fp8 GEMM whose every partial sum is exact in fp32: integer operands on the e4m3 grid, small enough that each
sum stays below 2^13, so any summation order, fast accumulation included (Hopper's fp8 accumulator keeps
about 14 bits, DeepSeek-V3 report section 3.3.2), gives the float64 product exactly. With Gaussian data the
emulation applies the scales before the GEMM (dequantized operands, fp32 products) and ``_scaled_mm`` after
it (fp8 products, scales on the fp32 sum), and the two sum in different orders: a tolerance.
"""

from __future__ import annotations

import copy
import dataclasses

import torch

from low_bits_training.formats import FORMATS, QuantSpec, fake_quantize
from low_bits_training.nn import GEMM_OPERANDS, QuantLinear, rng
from low_bits_training.nn.hardware import detect_hardware
from low_bits_training.nn.kernels import unsupported_reason
from low_bits_training.nn.recipes import RECIPES
from low_bits_training.nn.roles import ROLES, LinearPlan
from low_bits_training.nn.torchao_modules import torchao_linear
from low_bits_training.nn.torchao_recipes import torchao_recipe
from low_bits_training.plan.backends import torchao_kernel_refusal

from .catalog import RECIPES as SUMMARY

CAST_ROUNDINGS = ("nearest", "stochastic")
SCALE_ONLY = ("e8m0", "ue4m3")
"""Scale formats: cast with scaling "none" on positive values."""
PARITY_SHAPE = (256, 512, 384)
"""(M, K, N) of the parity checks: every block and tile size of the recipes divides it."""
REAL_RECIPES = ("fp8_tensorwise", "fp8_rowwise")
"""Recipes whose GEMMs ``torch._scaled_mm`` runs (the "real" backend, ``nn.kernels``)."""
EXACT_SHAPE = (128, 512, 256)
"""(M, K, N) of the bit-exact GEMM: integers in [-4, 4], so every partial sum is an integer below 2^13."""
BF16_ULP = 2.0**-7
"""One bf16 ulp, relative: the tolerance of a bf16 output computed two ways."""


def row(status: str, detail: str = "", **numbers) -> dict:
    """One result row (the runner adds the item's name, level and seconds)."""
    return {"status": status, "detail": detail, **numbers}


def per_recipe(check, recipes) -> list[dict]:
    """``check(recipe)`` for each recipe; an exception is that recipe's failed row, the others still run."""
    out = []
    for recipe in recipes:
        try:
            out.append(check(recipe))
        except Exception as e:
            why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            out.append(row("fail", why, recipe=recipe))
    return out


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other is NaN (payloads aside)."""
    a, b = a.detach().cpu().float(), b.detach().cpu().float()
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan]))


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in float64."""
    a, b = a.detach().cpu().double(), b.detach().cpu().double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def cast_parity(fmt: str, rounding: str, devices: tuple[str, str] = ("cpu", "cuda")) -> dict:
    """One format's cast on two devices, bit for bit (stochastic rounding from the same key)."""
    scaling = "none" if fmt in SCALE_ONLY or fmt in ("fp32", "bf16", "fp16") else "tensor"
    spec = QuantSpec(fmt, scaling, rounding=rounding)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    x = x.abs() + 1e-3 if fmt in SCALE_ONLY else x
    outs = [fake_quantize(x.to(d), spec, torch.tensor(1234, device=d)) for d in devices]
    ok = bits_equal(*outs)
    return row("ok" if ok else "fail", "bit for bit" if ok else "differs", case=f"{fmt} {rounding}")


def cast_rows(ctx) -> list[dict]:
    """Every format's cast (nearest and stochastic) on CUDA against the CPU."""
    return [cast_parity(f, r) for f in FORMATS for r in CAST_ROUNDINGS]


def operands(device: str, dtype=torch.float32, shape=PARITY_SHAPE):
    """(nn.Linear, x, dy) of ``shape`` (M, K, N), seeded."""
    m, k, n = shape
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
    x, dy = torch.randn(m, k, generator=g), torch.randn(m, n, generator=g) * 1e-3
    return lin.to(device, dtype), x.to(device, dtype), dy.to(device, dtype)


def fwd_bwd(module: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    """[y, dx, dW] of one forward + backward."""
    xg = x.detach().clone().requires_grad_()
    y = module(xg)
    y.backward(dy)
    return [y.detach(), xg.grad, module.weight.grad]


def recipe_parity(recipe: str, devices: tuple[str, str] = ("cpu", "cuda")) -> dict:
    """A recipe's casts bit for bit on two devices; its three GEMM outputs equal up to fp32 summation order
    (the emulation's matmul sums in cuBLAS's order on the GPU, oneDNN's on the CPU)."""
    plan = LinearPlan.from_recipe(recipe)
    runs = []
    rng.set_step_key(12345)  # counter-based SR bits (nn.rng): the same on every device
    try:
        for device in devices:
            lin, x, dy = operands(device)
            casts = [
                fake_quantize(t, s, torch.tensor(7, device=device))
                for t, s in _role_tensors(plan, lin, x, dy)
            ]
            runs.append((casts, fwd_bwd(QuantLinear.from_linear(lin, plan), x, dy)))
    finally:
        rng.set_step_key(None)
    (c_a, o_a), (c_b, o_b) = runs
    casts_ok = all(bits_equal(a, b) for a, b in zip(c_a, c_b, strict=True))
    rel = max(rel_diff(a, b) for a, b in zip(o_a, o_b, strict=True))
    ok = casts_ok and rel <= 1e-5
    detail = f"casts {'bit for bit' if casts_ok else 'DIFFER'}; GEMM outputs max rel diff {rel:.1e} (<= 1e-5)"
    return row("ok" if ok else "fail", detail, recipe=recipe, max_rel_diff=rel)


def recipe_rows(ctx) -> list[dict]:
    """Every quantized recipe's QuantLinear on CUDA against the CPU."""
    return per_recipe(recipe_parity, [r for r in RECIPES if r != "bf16"])


def _role_tensors(plan: LinearPlan, lin, x, dy) -> list[tuple[torch.Tensor, QuantSpec]]:
    tensors = {"input": x, "weight": lin.weight.detach(), "grad_output": dy}
    out = []
    for role, spec in zip(ROLES, plan.specs, strict=True):
        if spec is not None:
            t = tensors[role.operand]
            out.append((t if role.axis == -1 else t.t().contiguous(), dataclasses.replace(spec, axis=-1)))
    return out


def rowwise_out_dtype(device: str) -> torch.dtype:
    """The output dtype ``torch._scaled_mm`` allows with row scales here: fp32 on the CPU and SM90 (cuBLAS),
    bf16 elsewhere (ATen's ``_scaled_mm``: "Only bf16 and fp16 high precision output types are supported for
    row-wise scaling" on SM100 and before SM90)."""
    if device == "cpu" or torch.cuda.get_device_capability(0) == (9, 0):
        return torch.float32
    return torch.bfloat16


def scaled_mm_exact(device: str, rowwise: bool, fast_accum: bool) -> dict:
    """``torch._scaled_mm`` (fp8 e4m3) against the float64 product of the same fp8 values, rounded once to
    the output dtype: bit for bit, as every partial sum is an exact integer (module doc). Row scales are
    powers of two, so applying them is exact too; a bf16 output (``rowwise_out_dtype``) rounds the exact
    value once, as the float64 reference does."""
    m, k, n = EXACT_SHAPE
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randint(-4, 5, s, generator=g).float() for s in ((m, k), (k, n)))
    sa = 2.0 ** torch.randint(-3, 4, (m, 1), generator=g).float() if rowwise else torch.tensor(1.0)
    sb = 2.0 ** torch.randint(-3, 4, (1, n), generator=g).float() if rowwise else torch.tensor(1.0)
    fp8 = torch.float8_e4m3fn
    qa, qb = a.to(device, fp8), b.to(device, fp8).t().contiguous().t()  # B column-major
    out = rowwise_out_dtype(device) if rowwise else torch.float32
    got = torch._scaled_mm(qa, qb, sa.to(device), sb.to(device), out_dtype=out, use_fast_accum=fast_accum)
    want = ((a.double() @ b.double()) * sa.double() * sb.double()).to(out)
    ok = bits_equal(got, want)
    case = f"{'rowwise' if rowwise else 'tensorwise'}{', fast accum' if fast_accum else ''}"
    case += "" if out == torch.float32 else f", {str(out)[6:]} output"
    detail = "bit for bit with the float64 product" if ok else f"differs: max rel {rel_diff(got, want):.1e}"
    cell = f"GEMM{' (fast accum)' if fast_accum else ''} on exact sums: {'bit-exact' if ok else 'DIFFERS'}"
    recipe = "fp8_rowwise" if rowwise else "fp8_tensorwise"
    return row(
        "ok" if ok else "fail",
        detail,
        case=case,
        recipe=recipe,
        exactness="bit-exact",
        summary={"exactness": cell},
    )


def no_scaled_mm(recipe: str) -> dict:
    """Why ``recipe``'s forward GEMM has no ``torch._scaled_mm`` to compare with (``nn.kernels``)."""

    plan, op = LinearPlan.from_recipe(recipe), GEMM_OPERANDS["forward"]
    why = unsupported_reason(plan.specs[op.a], plan.specs[op.b])
    return row(
        "info",
        f"no _scaled_mm comparison: {why}",
        recipe=recipe,
        summary={"exactness": f"_scaled_mm: n/a ({why})"},
    )


def scaled_mm_exact_rows(ctx) -> list[dict]:
    """The exact ``_scaled_mm`` cases this device runs (fast accumulation: CUDA only), and why the other
    summary recipes have none."""
    cases = [(False, False), (True, False)] + ([(False, True), (True, True)] if ctx.device == "cuda" else [])
    others = [no_scaled_mm(r) for r in SUMMARY if r not in ("bf16", *REAL_RECIPES)]
    return [scaled_mm_exact(ctx.device, r, f) for r, f in cases] + others


def real_vs_emulation(recipe: str, device: str) -> dict:
    """Our "real" backend (``torch._scaled_mm``) against the emulation of the same plan, bf16 inputs."""
    plan = LinearPlan.from_recipe(recipe)
    lin, x, dy = operands(device, torch.bfloat16)
    real = LinearPlan(plan.specs, ("real",) * 3)
    outs = [fwd_bwd(QuantLinear.from_linear(copy.deepcopy(lin), p), x, dy) for p in (plan, real)]
    rel = max(rel_diff(a, b) for a, b in zip(*outs, strict=True))
    why = ("tolerance (one bf16 ulp): scales applied after the fp32 sum in _scaled_mm, before it in the emulation; "
           "summation orders differ")  # fmt: skip
    cell = f"_scaled_mm: rel {rel:.1e} ({'tol' if rel <= BF16_ULP else 'FAIL'})"
    return row("ok" if rel <= BF16_ULP else "fail", f"max rel diff {rel:.1e}; {why}", recipe=recipe,
               max_rel_diff=rel, exactness=why, summary={"exactness": cell})  # fmt: skip


def real_vs_emulation_rows(ctx) -> list[dict]:
    """Both recipes ``_scaled_mm`` runs, against the emulation, on this device (rowwise: where
    ``_scaled_mm`` gives the fp32 output ``nn.kernels.scaled_mm`` asks for)."""
    out = []
    for recipe in REAL_RECIPES:
        if recipe == "fp8_rowwise" and rowwise_out_dtype(ctx.device) != torch.float32:
            why = "skip: torch._scaled_mm gives row-scaled GEMMs only a bf16/fp16 output here; nn.kernels asks fp32"
            out.append(row("skip", why, recipe=recipe))
        else:
            out.append(real_vs_emulation(recipe, ctx.device))
    return out


TORCHAO_TOLERANCE = {
    "Float8Linear": "tolerance (2^-6): the forward GEMM uses fast accumulation; bf16 output rounded after scaling",
    "MXFP8Linear": "tolerance (2^-6): torchao's GEMM sums the block products in its own order, bf16 output",
    "NVFP4Linear": "forward only, tolerance (2^-6): the same fp4 codes and scales (nvfp4_torchao), summed in "
    "torchao's order, bf16 output; the gradients are stochastically rounded (no two draws agree)",
}


def torchao_vs_emulation(recipe: str, device: str, emulated: bool = False) -> dict:
    """torchao's module (its kernel; ``emulated``: its emulated mode) against our emulation, bf16 inputs."""

    plan = LinearPlan.from_recipe(recipe)
    lin, x, dy = operands(device, torch.bfloat16)
    ours = fwd_bwd(QuantLinear.from_linear(copy.deepcopy(lin), plan), x, dy)
    theirs = fwd_bwd(torchao_linear(copy.deepcopy(lin), plan, emulated=emulated), x, dy)
    module = torchao_recipe(plan).module
    compared = 1 if module == "NVFP4Linear" else 3  # [y] or [y, dx, dW]
    rel = max(rel_diff(a, b) for a, b in zip(theirs[:compared], ours[:compared], strict=True))
    why = TORCHAO_TOLERANCE[module]
    ok = rel <= 2.0**-6
    return row("ok" if ok else "fail", f"max rel diff {rel:.1e}; {why}", recipe=recipe, max_rel_diff=rel,
               exactness=why, summary={"exactness": f"torchao: rel {rel:.1e} ({'tol' if ok else 'FAIL'})"})  # fmt: skip


def torchao_rows(ctx) -> list[dict]:
    """Each summary recipe torchao computes: its kernel against our emulation where this GPU has the kernel,
    else a skip with ``plan.backends``' reason (MXFP8 needs SM100: no false failure on an H100)."""

    hw = detect_hardware()

    def check(recipe: str) -> dict:
        why = torchao_kernel_refusal(torchao_recipe(LinearPlan.from_recipe(recipe)), hw)
        return row("skip", f"skip: {why}", recipe=recipe) if why else torchao_vs_emulation(recipe, ctx.device)

    routed = [r for r in (*SUMMARY, *TORCHAO_ONLY) if torchao_recipe(LinearPlan.from_recipe(r)) is not None]
    return per_recipe(check, routed)


TORCHAO_ONLY = ("nvfp4_torchao",)
"""Recipes outside the summary whose torchao module is compared with our emulation (SM100 only)."""
