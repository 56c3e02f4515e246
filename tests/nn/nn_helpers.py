"""Shared helpers for the nn tests: SQNR and a reference linear in fp32."""

from __future__ import annotations

import torch

from low_bits_training.nn import LinearPlan, quant_linear
from low_bits_training.nn.recipes import recipe_specs


def sqnr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    """10 log10(|ref|^2 / |x - ref|^2) in dB (inf when equal)."""
    ref, x = ref.double(), x.double()
    err = (x - ref).pow(2).sum()
    return float("inf") if err == 0 else (10 * torch.log10(ref.pow(2).sum() / err)).item()


def plan_for(recipe: str, backend: str = "emulate") -> LinearPlan:
    return LinearPlan.from_roles(recipe_specs(recipe), backend)


def linear_grads(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, plan: LinearPlan | None):
    """(y, dx, dw) of ``quant_linear`` (plan) or of the fp32 ``x @ w.T`` (plan None)."""
    xg = x.detach().clone().requires_grad_()
    wg = w.detach().clone().requires_grad_()
    if plan is None:
        y = xg.double() @ wg.double().t()
    else:
        y = quant_linear(xg, wg, None, plan)
    y.backward(dy.to(y.dtype))
    return y.detach(), xg.grad, wg.grad


def operands(m: int = 256, k: int = 256, n: int = 384, dtype=torch.float32, seed: int = 0):
    """x (m,k), w (n,k), dy (m,n): activations with a few outlier channels, as in real models."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (1 + 4 * (torch.rand(k, generator=g) > 0.95))
    w = torch.randn(n, k, generator=g) / k**0.5
    dy = torch.randn(m, n, generator=g) * 1e-3
    return x.to(dtype), w.to(dtype), dy.to(dtype)


def saved_bytes(fn, *args) -> dict[tuple, int]:
    """Bytes autograd keeps for the backward of ``fn(*args)`` (then run on its sum), by (shape, dtype)."""
    saved: dict[tuple, int] = {}

    def pack(t):
        key = (tuple(t.shape), t.dtype)
        saved[key] = saved.get(key, 0) + t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args).sum().backward()
    return saved
