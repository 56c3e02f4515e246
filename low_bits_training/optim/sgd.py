"""Momentum SGD whose momentum buffer lives in any format of the numerics core (update in fp32)."""

from __future__ import annotations

from .base import LowBitOptimizer
from .dist import local
from .options import SGDOptions


class LowBitSGD(LowBitOptimizer):
    """torch.optim.SGD's update (dampening 0; weight decay added to the gradient, as torch does) with a
    quantized momentum buffer and master weights. With an fp32 buffer it equals torch's for-loop SGD.

    Args:
        params: parameters or param group dicts.
        **defaults: ``SGDOptions`` fields (``lr`` required).

    Raises:
        ValueError: an invalid option (one line).
    """

    options_cls = SGDOptions

    def _update(self, p, state, group, opts: SGDOptions, step: int, gen_fn, rows) -> None:
        lr, mu = float(group["lr"]), opts.momentum
        w, g = local(p)[rows], local(p.grad)[rows].float()
        w32 = w.float()
        if opts.weight_decay:
            g = g.add(w32, alpha=opts.weight_decay)
        buf = self.read(p, state, "momentum_buffer", opts, rows)
        buf = g.clone() if step == 1 else buf.mul_(mu).add_(g)
        self.write(p, state, "momentum_buffer", opts, buf, gen_fn, rows)
        d = g.add(buf, alpha=mu) if opts.nesterov else buf
        w32.add_(d, alpha=-lr)
        self.finish(p, state, opts, w32, gen_fn, rows)
