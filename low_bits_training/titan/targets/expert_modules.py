"""The modules ``convert_experts`` (``titan.targets.experts``) builds for the plan's expert weights: our
grouped-experts module (``TitanQuantGroupedExperts``, the three grouped matmuls by the plan) and the
static-shape padding token dispatcher (``PaddedTokenDispatcher``, triton-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common.moe import GroupedExperts
from torchtitan.models.common.token_dispatcher import TorchAOTokenDispatcher

from low_bits_training.nn import LinearPlan
from low_bits_training.nn.grouped import GroupedQuantState, grouped_linear
from low_bits_training.titan.targets.kind import TitanQuantState

WEIGHTS = ("w1", "w2", "w3")
"""The plan's names of the three stacked expert weights (``<experts fqn>.w1`` ...)."""
_PARAMS = {"w1": "w1_EFD", "w2": "w2_EDF", "w3": "w3_EFD"}


def pad_token_groups(
    x: torch.Tensor, counts: torch.Tensor, ranks: int, experts: int, multiple: int
) -> tuple[torch.Size, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reorder rank-major token segments to expert-major and zero-pad each expert's group to ``multiple``.

    torchao's ``permute_and_pad`` (what torchtitan's ``TorchAOTokenDispatcher`` calls) in plain torch ops
    with static shapes (its index kernel is triton-only): the output has ``round_up(R + experts *
    multiple, multiple)`` rows whatever the routing, so torch.compile sees one shape. An expert with no
    tokens still gets ``multiple`` zero rows (as in torchao).

    Args:
        x: (R, D) tokens, segment (rank r, expert j) at the rank-major position of ``counts``.
        counts: (ranks * experts,) tokens per (rank, local expert), rank-major.
        ranks: expert-parallel ranks the segments came from (1 without EP).
        experts: local experts.
        multiple: row multiple of every expert group.

    Returns:
        ``(shape, padded, indices, sizes)``: the shape of x with one zero row appended, the (L, D) padded
        tokens, the (L,) row of that extended x each output row came from (R: the zero row), and the
        (experts,) int32 padded group sizes.
    """
    n = x.shape[0]
    length = -(-(n + experts * multiple) // multiple) * multiple
    c = counts.view(ranks, experts).to(torch.int64)
    start = (counts.cumsum(0) - counts).view(ranks, experts)  # input row of segment (r, j)
    total = c.sum(0)
    sizes = -(-total.clamp_min(multiple) // multiple) * multiple
    ends = sizes.cumsum(0)
    p = torch.arange(length, device=x.device)
    j = torch.searchsorted(ends, p, right=True).clamp_max(experts - 1)
    q = p - (ends - sizes)[j]  # position inside expert j's group
    cum = c.cumsum(0).t()  # (experts, ranks): tokens of expert j from ranks 0..r
    r = (cum[j] <= q[:, None]).sum(1).clamp_max(ranks - 1)
    src = start[r, j] + q - (cum[j, r] - c.t()[j, r])
    real = (p < ends[-1]) & (q < total[j])
    idx = torch.where(real, src, n)
    xe = torch.cat([x, x.new_zeros(1, x.shape[1])])
    return xe.shape, xe[idx], idx, sizes.to(torch.int32)


class PaddedTokenDispatcher(TorchAOTokenDispatcher):
    """torchtitan's padding dispatcher (``TorchAOTokenDispatcher``) with ``pad_token_groups`` as its permute:
    no triton, static shapes, EP all-to-all inherited."""

    @dataclass(kw_only=True, slots=True)
    class Config(TorchAOTokenDispatcher.Config):
        pass

    def _permute(
        self, routed_input_RD, num_global_tokens_per_local_expert_E
    ):  # compat.UPSTREAM token_permute
        ranks = self.ep_mesh.size() if self.ep_mesh is not None else 1
        experts = num_global_tokens_per_local_expert_E.shape[0] // ranks
        shape, x, idx, sizes = pad_token_groups(
            routed_input_RD, num_global_tokens_per_local_expert_E, ranks, experts, self.pad_multiple
        )
        return shape, x, idx, sizes


class TitanExpertWeightState(GroupedQuantState, TitanQuantState):
    """``GroupedQuantState`` under torchtitan's Module protocol (``titan.targets.kind.TitanQuantState``)."""


class TitanQuantGroupedExperts(GroupedExperts):
    """``GroupedExperts`` whose three grouped matmuls follow the plan (``nn.grouped.grouped_linear``).

    Parameters and state_dict keys are ``GroupedExperts``'s; the plan and the key / probe buffers of each
    weight live in a parameter-free child named like the plan entry (``w1``, ``w2``, ``w3``).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        plans: dict[str, LinearPlan] = field(default_factory=dict)
        """Plan of each stacked weight: ``{"w1": ..., "w2": ..., "w3": ...}``."""
        fqn: str = ""
        """The experts module's FQN (keys each weight's stochastic-rounding stream)."""
        pad: int = 1
        """The row multiple the dispatcher pads each expert's tokens to (for the plans of every phase)."""

    def __init__(self, config: Config):
        super().__init__(config)
        for name in WEIGHTS:
            plan = config.plans.get(name, LinearPlan())
            self.add_module(name, TitanExpertWeightState(plan, f"{config.fqn}.{name}", pad=config.pad))

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)

        def mm(x: torch.Tensor, name: str) -> torch.Tensor:
            w = getattr(self, _PARAMS[name])
            w = w.to_local() if isinstance(w, DTensor) else w  # as GroupedExperts.forward does
            st = getattr(self, name)
            return grouped_linear(x, w, offs, st.plan, st.state)

        h = F.silu(mm(x_RD, "w1")) * mm(x_RD, "w3")
        return mm(h, "w2").type_as(x_RD)
