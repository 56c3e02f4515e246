"""Momentum SGD whose momentum buffer lives in any format of the numerics core (update in fp32)."""

from __future__ import annotations

from .base import LowBitOptimizer
from .codec import StateCodec
from .options import SGDOptions


class LowBitSGD(LowBitOptimizer):
    """torch.optim.SGD's update (dampening 0; coupled L2 weight decay: ``weight_decay * w`` is added to the
    gradient, as torch does) with a quantized momentum buffer and master weights
    (``optim.kernels.sgd_chunk``). With an fp32 buffer it matches torch's for-loop SGD to an ulp or two.

    Args:
        params: parameters or param group dicts.
        **defaults: ``SGDOptions`` fields (``lr`` required).

    Raises:
        ValueError: an invalid option (one line).
    """

    options_cls = SGDOptions
    kind = "sgd"

    def flags(self, opts: SGDOptions, codecs: dict[str, StateCodec]) -> tuple[str, ...]:
        return tuple(f for f, on in (("nesterov", opts.nesterov), ("decay", opts.weight_decay != 0)) if on)

    def hyper(self, group, opts: SGDOptions, step: int) -> list[float]:
        return [opts.weight_decay, opts.momentum, float(group["lr"]), 1.0 if step == 1 else 0.0]
