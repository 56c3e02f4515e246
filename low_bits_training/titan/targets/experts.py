"""Mixture-of-experts inside the precision plan: the grouped-experts converter (the modules it builds:
``titan.targets.expert_modules``; the CPU-sized Qwen3-MoE base: ``titan.launch.bases.qwen3_moe_tiny``).

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
from torchtitan.models.common.moe import GroupedExperts, MoE
from torchtitan.tools.logging import logger

from low_bits_training.errors import ConfigError
from low_bits_training.nn import LinearPlan
from low_bits_training.nn.grouped import pad_multiple
from low_bits_training.nn.recipes import recipe_specs
from low_bits_training.nn.torchao_recipes import TorchaoGroupedRecipe, torchao_grouped_recipe
from low_bits_training.plan.options import grouped_specs
from low_bits_training.plan.resolve import LayerShape
from low_bits_training.titan.platform.compat import config_owner, grouped_experts_class
from low_bits_training.titan.targets.expert_modules import (
    WEIGHTS,
    PaddedTokenDispatcher,
    TitanQuantGroupedExperts,
)
from low_bits_training.titan.targets.kind import TargetKind


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
