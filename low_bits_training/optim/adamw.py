"""AdamW whose moments live in any format of the numerics core; the update is computed in fp32."""

from __future__ import annotations

import math

import torch

from .base import LowBitOptimizer
from .dist import local
from .options import AdamWOptions


def moment_bound(beta1: float, beta2: float) -> float | None:
    """C with |m_t| <= C sqrt(v_t) for Adam's EMAs from zero (Cauchy-Schwarz), or None when beta1^2 >= beta2.

    m_t = (1-b1) sum_k b1^k g_k, v_t = (1-b2) sum_k b2^k g_k^2, so
    m_t^2 <= (1-b1)^2 (sum_k (b1^2/b2)^k) (sum_k b2^k g_k^2) = (1-b1)^2 / ((1-b2)(1 - b1^2/b2)) v_t.
    """
    if beta1**2 >= beta2:
        return None
    return (1 - beta1) / math.sqrt((1 - beta2) * (1 - beta1**2 / beta2))


class LowBitAdamW(LowBitOptimizer):
    """AdamW (torch.optim.AdamW's update, same op order) with quantized moments and master weights.

    Each step: dequantize m and v to fp32, update them with the gradient, store them back (quantized), and
    take the step with the fresh fp32 m and v. With fp32 states and no master format the result equals
    ``torch.optim.AdamW(foreach=False)`` bit for bit.

    Args:
        params: parameters or param group dicts (torchtitan passes groups with ``param_names``).
        **defaults: ``AdamWOptions`` fields (``lr`` required).

    Raises:
        ValueError: an invalid option (one line).
    """

    options_cls = AdamWOptions

    def _update(self, p, state, group, opts: AdamWOptions, step: int, gen_fn, rows) -> None:
        lr, (b1, b2) = float(group["lr"]), opts.betas
        w, g = local(p)[rows], local(p.grad)[rows].float()
        m = self.read(p, state, "exp_avg", opts, rows)
        sq_codec = self.codec(p, "exp_avg_sq", opts)
        sqrt_stored = opts.sqrt_exp_avg_sq and not sq_codec.native
        v = self.read(p, state, "exp_avg_sq", opts, rows)
        if sqrt_stored:
            v = v.square_()
        w32 = w.float()
        w32.mul_(1 - lr * opts.weight_decay)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        self.write(p, state, "exp_avg", opts, m, gen_fn, rows)
        self.write(p, state, "exp_avg_sq", opts, v.sqrt() if sqrt_stored else v, gen_fn, rows)
        c = moment_bound(b1, b2)
        if opts.v_floor and c is not None and sq_codec.spec.format != "fp32":
            v = torch.maximum(v, m.square().div_(c * c))
        bc1, bc2 = 1 - b1**step, 1 - b2**step
        denom = (v.sqrt_() / math.sqrt(bc2)).add_(opts.eps)
        w32.addcdiv_(m, denom, value=-lr / bc1)
        self.finish(p, state, opts, w32, gen_fn, rows)
