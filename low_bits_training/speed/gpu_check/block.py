"""Step time of a Llama-3-8B-shaped transformer block per recipe, as a ratio to bf16 in the same process,
eager and compiled, next to the speed model's prediction.

The block is plain torch (no torchtitan): RMSNorm, a fused QKV projection, causal SDPA attention with
grouped KV heads (no RoPE: it costs the same in every recipe), the output projection, RMSNorm and a SwiGLU
FFN; its linears are what ``[quantize] backend = "auto"`` gives on this GPU (``plan.backends``): torchao's
module where it has the kernel, our ``QuantLinear`` emulation elsewhere. Recipes are interleaved (each
repeat runs every recipe, the order rotated) so clock and thermal drift hit all of them alike.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from low_bits_training.nn import LinearPlan, QuantLinear
from low_bits_training.nn.hardware import detect_hardware
from low_bits_training.nn.torchao_modules import torchao_linear
from low_bits_training.plan.backends import layer_backends
from low_bits_training.speed import predict
from low_bits_training.speed.gpus import gpu_for_device
from low_bits_training.speed.workloads import decoder_targets, llama3

from .catalog import RECIPES
from .compiling import compile_variants
from .parity import row


@dataclass(frozen=True)
class BlockShape:
    """A decoder block's dimensions and the tokens of one step (one sequence)."""

    dim: int = 4096
    n_heads: int = 32
    n_kv_heads: int = 8
    ffn: int = 14336
    tokens: int = 4096

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


LLAMA3_8B_BLOCK = BlockShape()
"""Llama 3 8B's block at 4096 tokens."""
COMPILE_MARGIN_S = 45
"""A compiled variant is not started with less budget left than this (a cold compile of one block)."""


class Block(nn.Module):
    """One pre-norm Llama block; ``linear(in, out)`` builds each projection."""

    def __init__(self, s: BlockShape, linear):
        super().__init__()
        self.s = s
        kv = s.n_kv_heads * s.head_dim
        self.attention_norm, self.ffn_norm = nn.RMSNorm(s.dim), nn.RMSNorm(s.dim)
        self.wqkv, self.wo = linear(s.dim, s.dim + 2 * kv), linear(s.dim, s.dim)
        self.w1, self.w3, self.w2 = linear(s.dim, s.ffn), linear(s.dim, s.ffn), linear(s.ffn, s.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (T, C)
        s, t = self.s, x.shape[0]
        kv = s.n_kv_heads * s.head_dim
        q, k, v = self.wqkv(self.attention_norm(x)).split([s.dim, kv, kv], dim=-1)
        q, k, v = [z.view(1, t, -1, s.head_dim).transpose(1, 2) for z in (q, k, v)]  # (1, H, T, D)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.wo(o.transpose(1, 2).reshape(t, s.dim))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


def make_block(recipe: str, s: BlockShape, device: str, hw) -> tuple[Block, str]:
    """The block of ``recipe`` (bf16 parameters) and the backends its linears got (``layer_backends``)."""

    plan, used = LinearPlan.from_recipe(recipe), set()

    def linear(k: int, n: int) -> nn.Module:
        lin = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
        backend = "high" if plan.is_high_precision else layer_backends(plan, "auto", hw, k, n)[0]
        used.add(backend)
        if backend == "torchao":
            return torchao_linear(lin, plan, emulated=False)
        return lin if backend == "high" else QuantLinear.from_linear(lin, plan)

    block = Block(s, linear).to(device, torch.bfloat16)
    return block, "/".join(sorted(used))


def step_ms(fn, x: torch.Tensor, dy: torch.Tensor, iters: int) -> float:
    """Median ms of ``fn(x).backward(dy)`` over ``iters`` runs (CUDA events on a GPU, else wall clock)."""
    cuda = x.device.type == "cuda"
    times = []
    for _ in range(iters):
        xi = x.detach().requires_grad_()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        fn(xi).backward(dy)
        if cuda:
            end.record()
            torch.cuda.synchronize()
        times.append(start.elapsed_time(end) if cuda else (time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def interleaved(variants: dict, x, dy, repeats: int, iters: int) -> dict[str, list[float]]:
    """``step_ms`` of every variant, ``repeats`` rounds, each round in an order rotated by one."""
    names, out = list(variants), {n: [] for n in variants}
    for r in range(repeats):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            out[name].append(step_ms(variants[name], x, dy, iters))
    return out


def predicted(recipe: str, s: BlockShape, device_name: str | None, hw=None) -> tuple[float, float] | None:
    """The speed model's step speedup over bf16 of this block on this GPU: as hardware kernels would run it,
    and as this package runs it (``predict(as_run=True)``: each linear's backend from ``layer_backends`` on
    ``hw``, emulated GEMMs at the emulation's dtype). None: a GPU the model does not know."""
    spec = gpu_for_device(device_name) if device_name else None
    if spec is None:
        return None
    model, plan = llama3(s.dim, 1, s.n_heads, s.n_kv_heads, s.ffn, 0), LinearPlan.from_recipe(recipe)
    dims = {name: (k, n) for name, k, n in model.linears}
    hw = hw or spec.hardware()

    def plan_of(name: str, block: int) -> LinearPlan:
        return LinearPlan(plan.specs, layer_backends(plan, "auto", hw, *dims[name]))

    targets = decoder_targets(model, 1, s.tokens, plan_of)
    return predict(targets, spec).speedup, predict(targets, spec, as_run=True).speedup


def warm(variants: dict, x, dy, ctx, mode: str) -> tuple[dict, dict[str, str]]:
    """Run each variant twice (a compiled one compiles here); those the budget has no room for, or that
    fail, are dropped with the reason."""
    kept, why = {}, {}
    for name, fn in variants.items():
        if mode == "compiled" and ctx.left() < COMPILE_MARGIN_S:
            why[name] = f"skip: {ctx.left():.0f} s of budget left, a compile needs ~{COMPILE_MARGIN_S} s"
            continue
        try:
            step_ms(fn, x, dy, 2)
            kept[name] = fn
        except Exception as e:  # reported in its row
            why[name] = f"fail: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return kept, why


def measure(ctx, recipes=RECIPES, s: BlockShape = LLAMA3_8B_BLOCK, modes=("eager", "compiled"), repeats: int = 3,
            iters: int = 5) -> dict[str, dict]:  # fmt: skip
    """Per recipe: its backends, and per mode its median ms and ratio to bf16 (or why it has none)."""

    hw = detect_hardware()
    g = torch.Generator(device=ctx.device).manual_seed(0)
    x = torch.randn(s.tokens, s.dim, device=ctx.device, dtype=torch.bfloat16, generator=g)
    dy = torch.randn(s.tokens, s.dim, device=ctx.device, dtype=torch.bfloat16, generator=g)
    built = {r: make_block(r, s, ctx.device, hw) for r in recipes}
    out = {r: {"backends": built[r][1]} for r in recipes}
    for mode in modes:
        fns = {r: b for r, (b, _) in built.items()}
        if mode == "compiled":
            fns = dict(zip(fns, compile_variants(list(fns.values())), strict=True))
        kept, why = warm(fns, x, dy, ctx, mode)
        times = interleaved(kept, x, dy, repeats, iters)
        base = statistics.median(times["bf16"]) if "bf16" in times else None
        for r in recipes:
            ms = statistics.median(times[r]) if r in times else None
            ratio = base / ms if ms and base else None
            out[r][mode] = {
                "ms": ms,
                "x_bf16": ratio,
                "why": why.get(r) or ("" if base else "no bf16 baseline"),
            }
    return out


def block_rows(ctx) -> list[dict]:
    """One row per summary recipe: eager and compiled ratio to bf16 (a speedup: > 1 is faster), the model's."""

    name = torch.cuda.get_device_name(0) if ctx.device == "cuda" else None
    res, out, hw = measure(ctx), [], detect_hardware()
    for recipe, r in res.items():
        pred = predicted(recipe, LLAMA3_8B_BLOCK, name, hw)
        model = f"kernels {pred[0]:.2f}, as run {pred[1]:.2f}" if pred else "- (GPU not in speed.gpus)"
        cells = {
            m: f"{r[m]['x_bf16']:.2f}" if r[m]["x_bf16"] else r[m]["why"] or "-"
            for m in ("eager", "compiled")
        }
        bad = any(r[m]["why"].startswith("fail") for m in ("eager", "compiled"))
        note = (
            ""
            if "emulate" not in r["backends"]
            else "; the model assumes hardware kernels, this ran emulated"
        )
        detail = f"{r['backends']}: eager x{cells['eager']}, compiled x{cells['compiled']}, model x{pred or '-'}{note}"
        summary = {"eager x bf16": cells["eager"], "compiled x bf16": cells["compiled"],
                   "model x bf16": model}  # fmt: skip
        kernels, as_run = pred or (None, None)
        out.append(row("fail" if bad else "ok", detail, recipe=recipe, predicted_kernels=kernels,
                       predicted_as_run=as_run, summary=summary, **r))  # fmt: skip
    return out
