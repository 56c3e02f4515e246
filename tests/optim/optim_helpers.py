"""Shared fixtures of the optimizer tests: a deterministic gradient stream and state read-back."""

from __future__ import annotations

import torch

from low_bits_training.optim import LowBitAdamW

SHAPES = ((64, 256), (24, 128), (256,))  # two matrices (quantized states) and a norm-like vector (fp32)


def params(seed: int = 0, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in SHAPES]


def grads(step: int) -> list[torch.Tensor]:
    """Gradients of step ``step``: Gaussian with per-row scales over ~4 decades (a wide dynamic range)."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for s in SHAPES:
        rows = torch.logspace(-4, 0, s[0]).reshape(-1, *([1] * (len(s) - 1)))
        out.append(torch.randn(s, generator=g) * rows[torch.randperm(s[0], generator=g)])
    return out


def run(opt: torch.optim.Optimizer, ps: list[torch.Tensor], steps: range) -> None:
    for k in steps:
        for p, gr in zip(ps, grads(k), strict=True):
            p.grad = gr.to(p.dtype, copy=True)
        opt.step()


def adamw(ps: list[torch.Tensor], **kw) -> LowBitAdamW:
    """LowBitAdamW over ``ps`` (eager unless ``fused=True``: test_fused.py holds the two equal)."""
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1, "fused": False, **kw}
    return LowBitAdamW([{"params": ps, "param_names": [f"p{i}" for i in range(len(ps))]}], **kw)


def moments(opt: LowBitAdamW, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantized (m, v) of ``p`` (v squared back when sqrt(v) is stored)."""
    opts = opt.options(opt.param_groups[0])
    m, v = opt.read(p, "exp_avg"), opt.read(p, "exp_avg_sq")
    if opts.sqrt_exp_avg_sq and not opt.codec(p, "exp_avg_sq").native:
        v = v.square()
    return m, v


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()
