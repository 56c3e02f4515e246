"""What-if statistics inside the graph: a layer measures alternative formats on its live GEMM operands.

On a statistics step a ``WhatIfLinear`` with a ``WhatIf`` table records, for every alternative and role it
names, the statistics (``numerics.whatif``) of casting the very operand its GEMM receives (the input x and the
weight in forward, the output gradient dy in backward) with the alternative's spec, into the non-persistent
buffer ``lbt_whatif`` (alternatives x roles x ``WHATIF_SIZE``). The layer's own computation is untouched:
forward records x and W directly, and an identity autograd.Function on the output records dy in backward.
A layer whose plan is all high precision therefore stays exactly ``F.linear`` (values and gradients).

Like the plan, the table is a graph constant; the buffer is mutated in the graph (``nn.probe``): compiled
and eager record the same numbers. Stochastic-rounding alternatives take counter-based keys from (step key,
layer key, alternative, role), never torch's global RNG.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from low_bits_training.formats import QuantSpec, fold_key, hadamard
from low_bits_training.numerics.whatif import whatif_identity

from . import probe, rng
from .linear import QuantLinear
from .probe import ProbeMode
from .roles import ROLE_NAMES, ROLES, along_contraction

_KEY_OFFSET = 1 << 10
"""What-if keys fold in ``_KEY_OFFSET + alternative x len(ROLES) + role``: far from the plan's own role
indices (0..5), so an alternative never reuses the bits of the layer's real cast."""


@dataclass(frozen=True)
class WhatIf:
    """The alternatives one layer measures: ``specs[k][i]`` is alternative k's spec for ``ROLES[i]``."""

    names: tuple[str, ...]
    """Alternative names as ``numerics.jsonl`` marks them (a recipe name or a custom spec's name)."""
    specs: tuple[tuple[QuantSpec | None, ...], ...]
    """Per alternative, one spec (or None: not measured) per role in ``ROLES`` order; stored with the axis
    along the role's contraction dim."""

    def __post_init__(self) -> None:
        if len(self.names) != len(self.specs) or any(len(s) != len(ROLES) for s in self.specs):
            raise ValueError(f"WhatIf needs one name and {len(ROLES)} specs per alternative")
        fixed = tuple(
            tuple(along_contraction(s, r) for s, r in zip(row, ROLES, strict=True)) for row in self.specs
        )
        object.__setattr__(self, "specs", fixed)

    def role_specs(self, role: int) -> tuple[QuantSpec | None, ...]:
        """Every alternative's spec for ``ROLES[role]``."""
        return tuple(row[role] for row in self.specs)


def new_buffer(n: int, device=None) -> torch.Tensor:
    """A fresh (reset) what-if buffer: (n alternatives, len(ROLES), WHATIF_SIZE) float64."""
    return whatif_identity().to(device).repeat(n, len(ROLES), 1)


def reset(buf: torch.Tensor) -> None:
    """Reset a what-if buffer in place (between steps, outside any graph)."""
    buf.copy_(whatif_identity().to(buf.device).expand_as(buf))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # DTensor (TP) -> this rank's operand


def _keys(layer_key: torch.Tensor, whatif: WhatIf, role: int) -> tuple[torch.Tensor | None, ...]:
    step = rng.step_key()
    base = layer_key if step is None else torch.bitwise_xor(step.to(layer_key.device), layer_key)
    return tuple(
        None
        if s is None or s.rounding != "stochastic"
        else fold_key(base, _KEY_OFFSET + k * len(ROLES) + role)
        for k, s in enumerate(whatif.role_specs(role))
    )


def record(buf, whatif: WhatIf, layer_key: torch.Tensor, mode: ProbeMode, role: int, t: torch.Tensor) -> None:
    """Record every alternative of ``ROLES[role]`` on operand ``t`` (see ``probe.record_whatif``).

    An alternative with an RHT (``QuantSpec.rht``) is measured on the transformed operand, as its GEMM would
    cast it (along the role's contraction dim); one with ``source = "forward"`` on the operand itself.
    """
    specs, keys = whatif.role_specs(role), _keys(layer_key, whatif, role)
    for key in sorted({(*s.rht_key, s.rht_output) for s in specs if s is not None}):
        sel = tuple(s if s is not None and (*s.rht_key, s.rht_output) == key else None for s in specs)
        first = next(s for s in sel if s is not None)
        u = hadamard.operand_rht(t, first, ROLES[role].axis) if key[0] else t
        probe.record_whatif(buf, mode, role, u, sel, keys)


class GradTap(torch.autograd.Function):
    """Identity on the layer output; in backward it records the what-if statistics of the output gradient
    dy (M, N) for the given grad_output roles, and passes dy on unchanged."""

    @staticmethod
    def forward(ctx, y, buf, whatif: WhatIf, layer_key, mode: ProbeMode, roles: tuple[int, ...]):
        # the buffer and key ride on ctx, not saved tensors (updated in place, as in QuantMatmul)
        ctx.buf, ctx.whatif, ctx.layer_key, ctx.mode, ctx.roles = buf, whatif, layer_key, mode, roles
        return y.view_as(y)

    @staticmethod
    def backward(ctx, dy):
        d2 = _local(dy)
        d2 = d2.reshape(-1, d2.shape[-1])  # (M, N)
        for role in ctx.roles:
            record(ctx.buf, ctx.whatif, ctx.layer_key, ctx.mode, role, d2)
        return dy, None, None, None, None, None


_R = {name: i for i, name in enumerate(ROLE_NAMES)}


def _roles(x: torch.Tensor, w: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The roles whose GEMM runs: (recorded in forward, recorded in backward). Without a gradient for x no
    dgrad GEMM runs, without one for W no wgrad GEMM (as in ``QuantMatmul``)."""
    grad = torch.is_grad_enabled()
    dx, dw = grad and x.requires_grad, grad and w.requires_grad
    fwd = [_R["forward.input"], _R["forward.weight"]]
    fwd += [_R["dgrad.weight"]] if dx else []
    fwd += [_R["wgrad.input"]] if dw else []
    bwd = ([_R["dgrad.grad_output"]] if dx else []) + ([_R["wgrad.grad_output"]] if dw else [])
    return tuple(fwd), tuple(bwd)


class WhatIfLinear(QuantLinear):
    """``QuantLinear`` that can also record what-if statistics (``attach_whatif``); without a table it is
    exactly ``QuantLinear``."""

    whatif: WhatIf | None = None

    def attach_whatif(self, whatif: WhatIf | None) -> None:
        """Measure ``whatif``'s alternatives from now on (None: stop), with a fresh ``lbt_whatif`` buffer."""
        self.whatif = whatif
        buf = None if whatif is None else new_buffer(len(whatif.names), self.lbt_stats.device)
        self.register_buffer("lbt_whatif", buf, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mode = probe.mode()
        if self.whatif is None or not mode.stats:
            return super().forward(x)
        fwd, bwd = _roles(x, self.weight)
        xl = _local(x)
        operands = {"input": xl.reshape(-1, xl.shape[-1]), "weight": _local(self.weight)}  # (M,K), (N,K)
        for role in fwd:
            record(self.lbt_whatif, self.whatif, self.lbt_key, mode, role, operands[ROLES[role].operand])
        y = super().forward(x)
        if bwd:
            y = GradTap.apply(y, self.lbt_whatif, self.whatif, self.lbt_key, mode, bwd)
        return y
