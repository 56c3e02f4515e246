"""Mixture-of-experts inside the precision plan: the grouped-experts converter and a CPU-sized Qwen3-MoE base.

torchtitan 0.3's MoE layers keep their routed experts in one ``GroupedExperts`` module
(``layers.N.moe.routed_experts.inner_experts``) with three stacked weights ``w1_EFD``, ``w2_EDF``,
``w3_EFD``; each is a grouped matmul over the expert-sorted tokens. The plan names them
``<experts fqn>.w1`` / ``.w2`` / ``.w3`` and gives each the six roles of a linear layer, per expert
(``nn.grouped``), so rules and ``skip`` select them by glob like linear layers (``*.inner_experts.*``).

``convert_experts`` swaps the quantized ``GroupedExperts.Config`` entries before the model is built:
- emulation (any device): ``TitanQuantGroupedExperts``; where a role blocks along the token dim, the token
  dispatcher becomes ``PaddedTokenDispatcher``, which zero-pads each expert's token group to
  ``nn.grouped.pad_multiple`` (torchtitan's MXFP8 MoE converter does the same with torchao's
  ``permute_and_pad``, whose index kernel is triton-only);
- where the resolved plan's backend is ``torchao`` (``plan.backends.grouped_backends``: a torchao grouped
  recipe, MXFP8 RCEIL with or without a high-precision wgrad on SM100, fp8 rowwise on SM89, on hardware that
  has it): torchtitan's own ``MXFP8GroupedExperts`` / ``Float8GroupedExperts`` and its padding dispatcher.
  Not run here: no GPU was available; the plan table and lbt-doctor ``--hardware sm100`` say where it would.
- ``torchao_emulated`` (``backend = "torchao"`` on a device without the kernel, MXFP8 RCEIL only): torchtitan's
  ``MXFP8GroupedExperts`` with torchao's ``mxfp8_emulated_rceil`` recipe (to_mx casts, bf16 grouped GEMMs)
  and ``PaddedTokenDispatcher``; runs on a CPU.
The three weights of one experts module share one torchtitan module, so torchao takes them only when all
three resolve to the same torchao recipe and backend; otherwise all three run our emulation.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field, fields

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.moe import GroupedExperts, MoE
from torchtitan.models.common.token_dispatcher import TorchAOTokenDispatcher
from torchtitan.trainer import Trainer

from low_bits_training.errors import ConfigError
from low_bits_training.nn import LinearPlan
from low_bits_training.nn.grouped import GroupedQuantState, grouped_linear, pad_multiple
from low_bits_training.nn.torchao_recipes import TorchaoGroupedRecipe, torchao_grouped_recipe
from low_bits_training.plan.resolve import LayerShape
from low_bits_training.titan.platform.compat import config_owner, grouped_experts_class, qwen3_builders
from low_bits_training.titan.targets.kind import TargetKind, TitanQuantState

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


def expert_layers(model_config, tp: int = 1) -> dict[str, LayerShape]:
    """The plan entries of every experts module: ``<fqn>.w1/.w2/.w3`` -> shape of one expert's weight.

    The token multiple is 0: the dispatcher pads each expert's tokens to whatever the plan's blocks need.
    """
    top_k = {f"{fqn}.": cfg.router.top_k for fqn, cfg, _, _ in model_config.traverse(MoE.Config)}
    out = {}
    for fqn, cfg, _, _ in model_config.traverse(GroupedExperts.Config):
        d, h = cfg.dim, cfg.hidden_dim
        k_of = next((k for prefix, k in top_k.items() if fqn.startswith(prefix)), 1)
        for name, (k, n) in zip(WEIGHTS, ((d, h), (h, d), (d, h)), strict=True):
            out[f"{fqn}.{name}"] = LayerShape(k, n, tokens_multiple=0, tp=tp, kind="experts", copies=k_of)
    return out


def expert_plans(model_config) -> dict[str, tuple[LinearPlan, str]]:
    """Every expert weight's plan as it stands in the model config tree, and the module that runs it
    (``GroupedExperts``, ``QuantGroupedExperts`` or torchtitan's torchao class)."""
    out = {}
    for fqn, cfg, _, _ in model_config.traverse(GroupedExperts.Config):
        plans = getattr(cfg, "plans", {})
        owner = config_owner(type(cfg))
        label = owner.__name__ if owner is not None else type(cfg).__qualname__.split(".")[0]
        if isinstance(cfg, TitanQuantGroupedExperts.Config):
            label = "QuantGroupedExperts"
        elif label in ("MXFP8GroupedExperts", "Float8GroupedExperts"):  # torchtitan's torchao classes
            label = f"torchao {label} ({getattr(cfg, 'recipe_name', 'rowwise')})"
        out.update({f"{fqn}.{n}": (plans.get(n, LinearPlan()), label) for n in WEIGHTS})
    return out


def grouped_module_label(plan: LinearPlan) -> str:
    """What ``convert_experts`` builds for an expert weight with this resolved plan (the plan table's and
    lbt-doctor's module column)."""
    if plan.is_high_precision:
        return "GroupedExperts"
    backend = plan.backends[0]
    if backend in ("torchao", "torchao_emulated"):
        recipe = torchao_grouped_recipe(plan)
        name = recipe.recipe_name if backend == "torchao" else recipe.emulated_name
        return f"torchao {recipe.module} ({name})"
    return "QuantGroupedExperts"


def _torchao_choice(plans: dict[str, LinearPlan]) -> tuple[TorchaoGroupedRecipe, str] | None:
    """The torchao recipe and its name when all three weights resolved to the same one on a torchao backend."""
    backends = {p.backends for p in plans.values()}
    recipes = {torchao_grouped_recipe(p) for p in plans.values()}
    if (
        len(backends) != 1
        or len(recipes) != 1
        or next(iter(backends))[0] not in ("torchao", "torchao_emulated")
    ):
        return None
    (recipe,) = recipes
    emulated = next(iter(backends))[0] == "torchao_emulated"
    return recipe, recipe.emulated_name if emulated else recipe.recipe_name


_PLANNED: dict[type, type] = {}


def _planned(kernel_cls: type) -> type:
    """torchtitan's torchao experts class with the plan kept on its config (``expert_plans`` reads it back)."""
    if kernel_cls not in _PLANNED:

        class Planned(kernel_cls):
            @dataclass(kw_only=True, slots=True)
            class Config(kernel_cls.Config):
                plans: dict[str, LinearPlan] = field(default_factory=dict)
                """Plan of each stacked weight (what the torchao recipe computes)."""

        Planned.__name__ = Planned.__qualname__ = kernel_cls.__name__
        _PLANNED[kernel_cls] = Planned
    return _PLANNED[kernel_cls]


def _torchao_config(cfg, recipe: TorchaoGroupedRecipe, name: str, plans: dict[str, LinearPlan], parent):
    from torchtitan.components.quantization.utils import swap_token_dispatcher

    if name == recipe.emulated_name:  # torchao's permute_and_pad is triton-only: our static-shape padding
        old = parent.token_dispatcher
        parent.token_dispatcher = PaddedTokenDispatcher.Config(
            num_experts=old.num_experts, top_k=old.top_k, pad_multiple=recipe.pad_multiple
        )
    else:
        swap_token_dispatcher(parent, recipe.pad_multiple)
    base = {f.name: getattr(cfg, f.name) for f in fields(cfg)}
    if recipe.module == "Float8GroupedExperts":
        cls = _planned(grouped_experts_class("float8", config_owner(type(cfg))))
        return cls.Config(**base, plans=plans)
    cls = _planned(grouped_experts_class("mxfp8", config_owner(type(cfg))))
    return cls.Config(**base, recipe_name=name, plans=plans)


def _emulated_config(cfg, fqn: str, plans: dict[str, LinearPlan], parent, every: list[LinearPlan]):
    multiple = math.lcm(*(pad_multiple(p) for p in every))
    old = parent.token_dispatcher
    if multiple > 1:
        parent.token_dispatcher = PaddedTokenDispatcher.Config(
            num_experts=old.num_experts, top_k=old.top_k, pad_multiple=multiple
        )
    base = {f.name: getattr(cfg, f.name) for f in fields(GroupedExperts.Config)}
    return TitanQuantGroupedExperts.Config(**base, plans=plans, fqn=fqn, pad=multiple)


def convert_experts(model_config, plans: dict[str, LinearPlan], parallelism, phases=()):
    """Swap every experts module the plan quantizes, in place (see the module docstring).

    Args:
        model_config: the model config tree.
        plans: the resolved plan of step 1 (``<experts fqn>.w1`` ... entries from ``expert_layers``; their
            backends say which module runs them, ``plan.backends.grouped_backends``).
        parallelism: ``config.parallelism``.
        phases: the plans of every phase and of evaluation (``Schedule.all``; default: ``plans`` alone). A
            module some phase quantizes is built as ours, its dispatcher padding for every phase's blocks,
            so the schedule and the autopilot can switch its plans mid-run.

    Raises:
        ConfigError: emulated quantized experts under expert or tensor parallelism.
    """
    phases = list(phases) or [plans]
    for fqn, cfg, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
        mine = {n: plans[f"{fqn}.{n}"] for n in WEIGHTS}
        every = [p[f"{fqn}.{n}"] for p in phases for n in WEIGHTS]
        if all(p.is_high_precision for p in every):
            continue
        choice = _torchao_choice(mine)
        if choice is not None:
            new = _torchao_config(cfg, *choice, mine, parent)
        else:  # ours; a weight resolved to torchao alone runs ours with its siblings (one module)
            _check_parallelism(fqn, parallelism)
            ours = {
                n: dataclasses.replace(p, backends=("emulate",) * len(p.backends)) for n, p in mine.items()
            }
            new = _emulated_config(cfg, fqn, ours, parent, every)
        setattr(parent, attr, new)


def zero_expert_counts(model_parts) -> None:
    """Zero the tokens-per-expert counts the MoE layers add up in their forwards (the load-balancing bias
    update reads them at the optimizer step, which zeroes them): a step run again (the autopilot's
    ``RedoStep``) must not count the dropped attempt's routing."""
    for part in model_parts:
        for mod in part.modules():
            counts = getattr(mod, "tokens_per_expert_E", None)
            if isinstance(counts, torch.Tensor):
                counts.zero_()


def _check_parallelism(fqn: str, parallelism) -> None:
    for key in ("expert_parallel_degree", "tensor_parallel_degree"):
        if getattr(parallelism, key, 1) > 1:
            raise ConfigError(
                f"parallelism.{key} = {getattr(parallelism, key)}: emulated quantized experts ({fqn}) run "
                "with data parallelism (FSDP2) only; set it to 1 or keep the experts in high precision "
                "(quantize.skip)"
            )


def _convert(config, run) -> None:
    """``convert_experts``, and one log line where the recipe's options were left out for the experts."""
    from torchtitan.tools.logging import logger

    from low_bits_training.nn.recipes import recipe_specs
    from low_bits_training.plan.options import grouped_specs

    phases = [p.plans for p in run.schedule.all()]
    convert_experts(config.model_spec.model, run.plans, config.parallelism, phases)
    specs = recipe_specs(config.quantize.recipe)
    if specs != grouped_specs(specs) and expert_plans(config.model_spec.model):
        logger.info(
            f"quantize.recipe = {config.quantize.recipe!r}: MoE expert weights take it without RHT, delayed "
            "scaling and forward-cast reuse (their grouped GEMM has none); the plan table shows their specs"
        )


KIND = TargetKind(
    name="experts",
    what="an MoE expert weight",
    switchable=True,
    entries=lambda config: expert_layers(
        config.model_spec.model, max(1, config.parallelism.tensor_parallel_degree)
    ),
    convert=_convert,
    label=lambda plans, fqn: grouped_module_label(plans[fqn]),
    current=expert_plans,
)
"""MoE expert weights as a kind of plan target (``titan.targets.registry``)."""


def _tiny_moe_model(n_layers: int, dim: int, experts: int, top_k: int, hidden: int, vocab: int):
    # torchtitan's own builders (models/qwen3/__init__.py) at a size that trains on a laptop CPU.
    from torchtitan.models.qwen3.model import Qwen3Model

    head_dim = 32
    embedding_init, linear_init, build_moe_layers, norm = qwen3_builders()
    return Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=embedding_init),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=linear_init),
        layers=build_moe_layers(
            n_layers=n_layers,
            dim=dim,
            n_heads=dim // head_dim,
            n_kv_heads=dim // head_dim // 2,
            head_dim=head_dim,
            moe_hidden_dim=hidden,
            num_experts=experts,
            top_k=top_k,
            attn_backend="flex",
            moe_comm_backend="standard",
            rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=4096, theta=1000000.0),
        ),
    )


def qwen3_moe_tiny() -> Trainer.Config:
    """torchtitan's Qwen3-MoE debug recipe on a 4-layer model: dim 128, 8 experts (top 2) of hidden 128.

    torchtitan's ``debugmodel_moe`` (8 layers, 64 experts, top 8, hidden 768) takes seconds per step on a
    CPU; this one keeps every part of the MoE (router, load-balancing bias, grouped experts, dispatcher).
    """
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    config = qwen3_moe_debug()
    config.model_spec.model = _tiny_moe_model(4, 128, 8, 2, 128, 2048)
    config.model_spec.flavor = "tiny_moe"
    config.loss.loss_fn.global_vocab_size = decoder_vocab_size(config.model_spec)
    return config
