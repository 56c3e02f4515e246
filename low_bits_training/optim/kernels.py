"""The update of one chunk of rows: decode the states, update in fp32, encode the states, write the weights.

These functions are the eager reference and, compiled by ``optim.fused``, the fast path: one definition, so
the two can only differ where inductor's kernels round differently from torch's eager ones, which
tests/optim/test_fused.py rules out bit for bit for every state format. To make that possible the update uses
only ops whose eager and compiled results agree: separate multiplies and adds (torch's eager ``lerp`` and
``addcmul`` fuse a multiply-add on CPU, inductor's do not), and ``sqrt_rn``.

Arguments of a chunk update: ``spec`` (``KernelSpec``, fixed per compiled kernel), the parameter rows ``w``,
gradient rows ``g``, ``hyper`` (fp32 vector of the step's scalars, so a new LR or step does not recompile),
``keys`` (int64 (purposes,) or None) and the stored parts of every state in ``spec.states`` order, then the
Kahan compensation rows when ``spec.master_rounding == "kahan"``.
"""

from __future__ import annotations

import torch

from .layout import KernelSpec
from .master import write_master


def sqrt_rn(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 square root, eager and compiled alike.

    torch's eager CPU ``sqrt`` is not correctly rounded (SLEEF/VML, within an ulp); inductor's is. Eagerly the
    root is taken in fp64 and rounded once to fp32, which is the correctly rounded result (a double rounding
    of sqrt through a format with more than 2p + 2 bits is innocuous).
    """
    if torch.compiler.is_compiling():
        return x.sqrt()
    return x.double().sqrt_().float()


class _Parts:
    """The stored parts of each state of a chunk, read (decode) and written (encode, in place) by name."""

    def __init__(self, spec: KernelSpec, parts: tuple[torch.Tensor, ...]) -> None:
        self.spec, self.by_name, i = spec, {}, 0
        for name, codec in spec.states:
            suffixes = list(codec.dtypes())
            self.by_name[name] = dict(zip(suffixes, parts[i : i + len(suffixes)], strict=True))
            i += len(suffixes)
        self.comp = parts[i] if spec.master_rounding == "kahan" else None

    def read(self, name: str, shape: torch.Size) -> torch.Tensor:
        return self.spec.codec(name).decode(self.by_name[name], tuple(shape))

    def write(self, name: str, x: torch.Tensor, keys: torch.Tensor | None) -> None:
        encoded = self.spec.codec(name).encode(x, self.spec.key(keys, name))
        for suffix, part in encoded.items():
            self.by_name[name][suffix].copy_(part)


def adamw_chunk(spec: KernelSpec, w, g, hyper, keys, *parts) -> None:
    """AdamW on a chunk (torch.optim.AdamW's update and op order, one rounding per op; see module doc)."""
    st = _Parts(spec, parts)
    decay, omb1, b2, omb2, sqrt_bc2, eps, neg_step, inv_c2 = hyper.unbind()
    g = g.float()
    m = st.read("exp_avg", g.shape)
    v = st.read("exp_avg_sq", g.shape)
    if "sqrt_v" in spec.flags:
        v = v * v
    m = m + (g - m) * omb1  # lerp(m, g, 1 - b1)
    v = v * b2 + (g * g) * omb2
    st.write("exp_avg", m, keys)
    st.write("exp_avg_sq", sqrt_rn(v) if "sqrt_v" in spec.flags else v, keys)
    if "v_floor" in spec.flags:
        v = torch.maximum(v, (m * m) * inv_c2)
    denom = sqrt_rn(v) / sqrt_bc2 + eps
    w32 = w.float() * decay + (m * neg_step) / denom
    write_master(w, w32, spec.master, spec.master_rounding, st.comp, spec.key(keys, "master"))


def sgd_chunk(spec: KernelSpec, w, g, hyper, keys, *parts) -> None:
    """Momentum SGD on a chunk (torch.optim.SGD's update, dampening 0, coupled L2 weight decay)."""
    st = _Parts(spec, parts)
    wd, mu, lr, first = hyper.unbind()
    g = g.float()
    w32 = w.float()
    if "decay" in spec.flags:
        g = g + w32 * wd
    buf = st.read("momentum_buffer", g.shape)
    buf = torch.where(first > 0, g, buf * mu + g)
    st.write("momentum_buffer", buf, keys)
    d = g + buf * mu if "nesterov" in spec.flags else buf
    write_master(w, w32 - d * lr, spec.master, spec.master_rounding, st.comp, spec.key(keys, "master"))


KERNELS = {"adamw": adamw_chunk, "sgd": sgd_chunk}
"""Chunk update of each ``KernelSpec.kind``."""
