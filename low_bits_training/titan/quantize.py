"""The precision plan inside torchtitan: QuantLinear as a config-tree module, the converter, the plan table.

torchtitan 0.3 builds the model from a config tree; its llama3 linears are ``Linear.Config`` entries
(models/common/linear.py). Like torchtitan's own ``Float8LinearConverter`` (components/quantization/float8.py),
``PrecisionPlanConverter`` replaces the selected entries before the model is built: with torchao's module
(``titan.torchao_backend``) where the resolved plan says ``torchao``, else with ``TitanQuantLinear.Config``.
Parameters and state_dict keys stay those of ``nn.Linear``, so checkpoints move between recipes and backends.
Linears a base's own torchtitan converter already swapped (``Float8Linear`` ...) are left as they are and shown
as ``torchtitan`` in the plan table.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.models.common.linear import Linear
from torchtitan.protocols.module import Module
from torchtitan.tools.logging import logger

from low_bits_training.config.backends import (
    Hardware,
    TorchaoOptions,
    detect_hardware,
    torchao_kernel_refusal,
    torchao_recipe,
    torchao_shape_refusal,
)
from low_bits_training.config.plan import LayerShape, resolve_plan
from low_bits_training.config.plan_table import plan_to_json
from low_bits_training.nn import LinearPlan, QuantLinear
from low_bits_training.nn.linear import HISTORY_BUFFER, STATE_BUFFERS
from low_bits_training.nn.whatif import WhatIfLinear
from low_bits_training.titan.attention import attention_layers, attention_plans, convert_attention
from low_bits_training.titan.comm import apply_comm
from low_bits_training.titan.moe import convert_experts, expert_layers, expert_plans


class TitanQuantLinear(WhatIfLinear, Module):
    """``QuantLinear`` that satisfies torchtitan's Module protocol (param init, sharding config), and can
    record what-if statistics (``nn.whatif``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        """``Linear.Config`` plus the layer's precision plan."""

        plan: LinearPlan = field(default_factory=LinearPlan)
        """Spec per GEMM operand role and backend per GEMM (see ``low_bits_training.nn.roles``)."""

    def __init__(self, config: Config):
        QuantLinear.__init__(
            self, config.in_features, config.out_features, bias=config.bias, plan=config.plan
        )
        # The key / probe buffers are made in _init_self_buffers, after torchtitan distributed the states
        # (a None slot is skipped there; the buffers are per-rank, never sharded or checkpointed).
        for name in STATE_BUFFERS:
            self.register_buffer(name, None, persistent=False)
        if (
            getattr(self, HISTORY_BUFFER, None) is not None
        ):  # delayed scaling: persistent, per rank (nn.delayed)
            self.register_buffer(HISTORY_BUFFER, None)

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        self.init_state_buffers(buffer_device if buffer_device is not None else self.weight.device)


class PrecisionPlanConverter(QuantizationConverter):
    """Swap ``Linear.Config`` entries where the plan quantizes something: torchao's module where the plan's
    backends say torchao, else ``TitanQuantLinear.Config``."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        plans: dict[str, LinearPlan] = field(default_factory=dict)
        """Resolved plan: linear-layer FQN -> LinearPlan (see ``config.plan.resolve_plan``)."""
        torchao: TorchaoOptions = field(default_factory=TorchaoOptions)
        """``[quantize.torchao]`` for the layers whose plan says torchao."""
        keep: list[str] = field(default_factory=list)
        """FQNs built as QuantLinear even where ``plans`` keeps them high: quantized in a later phase of the
        schedule (titan/schedule.py), or recording what-if statistics."""

    def __init__(self, config: Config):
        self.config = config

    def _layer_config(self, cfg, plan: LinearPlan):
        if plan.backends[0].startswith("torchao"):
            from low_bits_training.titan.torchao_backend import layer_config

            return layer_config(cfg, plan, self.config.torchao)
        return TitanQuantLinear.Config(
            in_features=cfg.in_features,
            out_features=cfg.out_features,
            bias=cfg.bias,
            param_init=cfg.param_init,
            sharding_config=cfg.sharding_config,
            plan=plan,
        )

    def convert(self, model_config):
        plans, keep = self.config.plans, set(self.config.keep)
        hits = [h for h in linear_configs(model_config) if not plans[h[0]].is_high_precision or h[0] in keep]
        for fqn, cfg, parent, attr in hits:
            new = self._layer_config(cfg, self.config.plans[fqn])
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        logger.info(f"Precision plan: {len(hits)} linear layers quantized")
        return model_config


def _ours() -> tuple[type, ...]:
    from low_bits_training.titan.torchao_backend import TORCHAO_CONFIGS

    return (Linear.Config, TitanQuantLinear.Config, *TORCHAO_CONFIGS)


def linear_configs(model_config) -> list:
    """``(fqn, config, parent, attr)`` of the linears the plan covers: exactly ``Linear.Config``, or one this
    package already converted (QuantLinear, torchao backend). Specialised subclasses keep their own forward;
    torchtitan's converted linears are ``converted_linears``."""
    ours = _ours()
    return [h for h in model_config.traverse(Linear.Config) if type(h[1]) in ours]


def converted_linears(model_config) -> dict[str, str]:
    """FQN -> module name of the linears a base's own torchtitan converter swapped (``Float8Linear`` ...)."""
    out = {}
    for fqn, cfg, _, _ in model_config.traverse(Linear.Config):
        if type(cfg) not in _ours() and type(cfg).__module__.startswith("torchtitan.components."):
            out[fqn] = module_label(cfg)
    return out


def plan_module_label(plan: LinearPlan) -> str:
    """What the converter builds for a layer with this resolved plan: ``Linear`` (high precision),
    ``torchao Float8Linear (rowwise)`` / ``torchao MXFP8Linear (mxfp8 rceil)``, or ``QuantLinear``."""
    if plan.is_high_precision:
        return "Linear"
    if plan.backends[0].startswith("torchao"):
        recipe = torchao_recipe(plan)
        return f"torchao {recipe.module} ({recipe.label})"
    return "QuantLinear"


def module_label(cfg) -> str:
    """What a linear config in the model tree builds (``plan_module_label`` for the linears the plan covers;
    ``torchtitan Float8Linear (tensorwise, emulate)`` for one a torchtitan converter swapped)."""
    name = type(cfg).__qualname__.split(".")[0]
    if type(cfg) is TitanQuantLinear.Config and cfg.plan.is_high_precision:
        return "QuantLinear"  # high now, quantized in another phase (or recording what-if statistics)
    if type(cfg) in _ours():
        return plan_module_label(getattr(cfg, "plan", LinearPlan()))
    if type(cfg).__module__.startswith("torchtitan.components."):
        ao = getattr(cfg, "_torchao_config", None)
        if ao is None:
            return f"torchtitan {name}"
        from low_bits_training.titan.torchao_backend import float8_label

        return f"torchtitan {name} ({float8_label(ao)}{', emulate' if ao.emulate else ''})"
    return name


def _log_fallbacks(plans: dict[str, LinearPlan], layers: dict[str, LayerShape], setting: str, hw) -> None:
    # Why a layer torchao could compute stays on our emulation (or runs torchao's emulated mode).
    reasons = {}
    for fqn, plan in plans.items():
        recipe = torchao_recipe(plan) if setting != "emulate" else None
        if recipe is not None and plan.backends[0] != "torchao":
            shape = layers[fqn]
            why = torchao_shape_refusal(recipe, shape.in_features, shape.out_features, shape.tp)
            why = why or torchao_kernel_refusal(recipe, hw)
            reasons.setdefault(f"{plan.backends[0]}: {why}", []).append(fqn)
    for why, fqns in reasons.items():
        logger.info(f"quantize.backend = {setting!r}: {len(fqns)} layers {why}")


def layer_shapes(config) -> dict[str, LayerShape]:
    """FQN -> shape of every layer the plan covers (before or after ``apply_precision_plan``)."""
    model = config.model_spec.model
    tp = max(1, config.parallelism.tensor_parallel_degree)
    layers = {
        fqn: LayerShape(c.in_features, c.out_features, config.training.seq_len, tp)
        for fqn, c, _, _ in linear_configs(model)
    }
    layers.update(expert_layers(model, tp))  # MoE expert weights: titan/moe.py
    layers.update(attention_layers(model, config.training.seq_len))  # attention products: titan/attention.py
    return layers


def plan_on(config, hw: Hardware, quantize=None) -> dict[str, LinearPlan]:
    """The resolved plan of ``config``'s model on hardware ``hw`` (this machine's: ``detect_hardware()``;
    another: lbt-doctor ``--hardware``). Works on the model tree before or after ``apply_precision_plan``.

    Args:
        config: the trainer config.
        hw: the hardware to judge on.
        quantize: a ``[quantize]`` section to use instead of ``config.quantize`` (doctor ``--recipe``).

    Raises:
        ConfigError: see ``config.plan.resolve_plan``.
    """
    converted = converted_linears(config.model_spec.model)
    return resolve_plan(quantize or config.quantize, layer_shapes(config), hw, converted)


def apply_precision_plan(config) -> dict[str, LinearPlan]:
    """Validate ``config.quantize`` against the model and rewrite the model config tree in place.

    Args:
        config: the ``LowBitsTrainer.Config`` (its ``model_spec.model`` is replaced).

    Returns:
        FQN -> LinearPlan for every covered linear layer.

    Raises:
        ConfigError: one line, before the model is built (see ``config.plan.resolve_plan``).
    """
    from low_bits_training.titan.numerics.whatif import whatif_on
    from low_bits_training.titan.schedule import schedule_on

    model, hw = config.model_spec.model, detect_hardware()
    schedule = schedule_on(config, hw)  # [[quantize.phases]], [quantize.eval]: titan/schedule.py
    plans = schedule.at(1).plans
    keep = [*schedule.quantized(), *whatif_on(config, plans)]
    _log_fallbacks(plans, layer_shapes(config), config.quantize.backend, hw)
    apply_comm(config, plans)  # [quantize.comm]: titan/comm.py
    converter = PrecisionPlanConverter.Config(plans=plans, torchao=config.quantize.torchao, keep=keep).build()
    config.model_spec.model = converter.convert(model)
    convert_experts(config.model_spec.model, plans, config.parallelism)  # MoE experts: titan/moe.py
    convert_attention(config.model_spec.model, plans, config.parallelism)  # attention: titan/attention.py
    if any(p.backends[0].startswith("torchao") for p in plans.values()):
        from low_bits_training.titan.torchao_backend import install_fsdp_scale_precompute

        install_fsdp_scale_precompute(config)
    return plans


def current_plans(config) -> tuple[dict[str, LinearPlan], dict[str, str]]:
    """The plan as it stands in the model config tree, and what each linear builds.

    Returns:
        FQN -> LinearPlan (high precision for unconverted linears; all-``torchtitan`` backends for linears a
        torchtitan converter swapped) and FQN -> module label (``module_label``), in model order.
    """
    model = config.model_spec.model
    ours = _ours()
    plans, modules = {}, {}
    for fqn, cfg, _, _ in model.traverse(Linear.Config):
        if type(cfg) in ours:
            plans[fqn] = getattr(cfg, "plan", LinearPlan())
        elif type(cfg).__module__.startswith("torchtitan.components."):
            plans[fqn] = LinearPlan(backends=("torchtitan",) * len(LinearPlan().backends))
        else:
            continue
        modules[fqn] = module_label(cfg)
    others = {**expert_plans(model), **attention_plans(model)}  # MoE experts, attention products
    for fqn, (plan, label) in others.items():
        plans[fqn], modules[fqn] = plan, label
    return plans, modules


def save_plan(config, folder: str | os.PathLike) -> Path:
    """Write ``precision_plan.txt`` (the table) and ``precision_plan.json`` into ``folder``; log the table.

    With a precision schedule the text has one table per phase (and the eval plan), and
    ``precision_schedule.json`` is written beside (titan/schedule.py).

    Returns:
        The path of the text table.
    """
    from low_bits_training.titan.schedule import plan_text

    plans, modules = current_plans(config)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    head = f"recipe={config.quantize.recipe} backend={config.quantize.backend} device={detect_hardware()}\n"
    text = head + plan_text(config, plans, modules, folder)
    (folder / "precision_plan.txt").write_text(text)
    (folder / "precision_plan.json").write_text(json.dumps(plan_to_json(plans, modules), indent=1) + "\n")
    logger.info("Precision plan:\n" + text)
    return folder / "precision_plan.txt"
