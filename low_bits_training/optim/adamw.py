"""AdamW whose moments live in any format of the numerics core; the update is computed in fp32."""

from __future__ import annotations

import math

from .base import LowBitOptimizer
from .codec import StateCodec
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
    """AdamW (torch.optim.AdamW's update and op order) with quantized moments and master weights.

    Each step, per chunk of rows: decode m and v to fp32, update them with the gradient, store them back
    (quantized), and take the step with the fresh fp32 m and v (``optim.kernels.adamw_chunk``). With fp32
    states and no master format the result is ``torch.optim.AdamW(foreach=False)``'s to an ulp or two (each op
    rounded once: torch's eager ``lerp`` / ``addcmul`` fuse multiply-adds and its CPU sqrt is not correctly
    rounded, which a compiled kernel cannot reproduce).

    Args:
        params: parameters or param group dicts (torchtitan passes groups with ``param_names``).
        **defaults: ``AdamWOptions`` fields (``lr`` required).

    Raises:
        ValueError: an invalid option (one line).
    """

    options_cls = AdamWOptions
    kind = "adamw"

    def flags(self, opts: AdamWOptions, codecs: dict[str, StateCodec]) -> tuple[str, ...]:
        sq = codecs["exp_avg_sq"]
        out = ("sqrt_v",) if opts.sqrt_exp_avg_sq and not sq.native else ()
        if opts.v_floor and moment_bound(*opts.betas) is not None and sq.spec.format != "fp32":
            out += ("v_floor",)
        return out

    def hyper(self, group, opts: AdamWOptions, step: int) -> list[float]:
        lr, (b1, b2) = float(group["lr"]), opts.betas
        c = moment_bound(b1, b2)
        return [
            1 - lr * opts.weight_decay,
            1 - b1,
            b2,
            1 - b2,
            math.sqrt(1 - b2**step),
            opts.eps,
            -lr / (1 - b1**step),
            1 / (c * c) if c else 0.0,
        ]
