"""The linear layers as a kind of plan target: QuantLinear as a config-tree module, its converter, its labels.

torchtitan 0.3 builds the model from a config tree; its llama3 linears are ``Linear.Config`` entries
(models/common/linear.py). Like torchtitan's own ``Float8LinearConverter`` (components/quantization/float8.py),
``PrecisionPlanConverter`` replaces the selected entries before the model is built: with torchao's module
(``titan.targets.torchao_backend``) where the resolved plan says ``torchao``, else with
``TitanQuantLinear.Config``. Parameters and state_dict keys stay those of ``nn.Linear``, so checkpoints move
between recipes and backends. Linears a base's own torchtitan converter already swapped (``Float8Linear`` ...)
are left as they are and shown as ``torchtitan`` in the plan table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan.components.quantization import QuantizationConverter
from torchtitan.models.common.linear import Linear
from torchtitan.models.common.moe import TokenChoiceTopKRouter
from torchtitan.tools.logging import logger

from low_bits_training.config.quantize import TorchaoOptions
from low_bits_training.nn import LinearPlan
from low_bits_training.nn.hardware import detect_hardware
from low_bits_training.nn.state import HISTORY_BUFFER, STATE_BUFFERS
from low_bits_training.nn.torchao_recipes import torchao_recipe
from low_bits_training.nn.whatif import WhatIfLinear
from low_bits_training.plan.backends import torchao_kernel_refusal, torchao_shape_refusal
from low_bits_training.plan.resolve import LayerShape
from low_bits_training.titan.platform.compat import torchao_config_of
from low_bits_training.titan.targets.kind import TargetKind, TitanQuantState
from low_bits_training.titan.targets.torchao_backend import (
    TORCHAO_CONFIGS,
    float8_label,
    install_fsdp_scale_precompute,
    layer_config,
)


class TitanQuantLinear(WhatIfLinear, TitanQuantState):
    """``QuantLinear`` that satisfies torchtitan's Module protocol (param init, sharding config), and can
    record what-if statistics (``nn.whatif``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        """``Linear.Config`` plus the layer's precision plan."""

        plan: LinearPlan = field(default_factory=LinearPlan)
        """Spec per GEMM operand role and backend per GEMM (see ``low_bits_training.nn.roles``)."""

    def __init__(self, config: Config):
        WhatIfLinear.__init__(
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


class PrecisionPlanConverter(QuantizationConverter):
    """Swap ``Linear.Config`` entries where the plan quantizes something: torchao's module where the plan's
    backends say torchao, else ``TitanQuantLinear.Config``."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        plans: dict[str, LinearPlan] = field(default_factory=dict)
        """Resolved plan: linear-layer FQN -> LinearPlan (see ``plan.resolve.resolve_plan``)."""
        torchao: TorchaoOptions = field(default_factory=TorchaoOptions)
        """``[quantize.torchao]`` for the layers whose plan says torchao."""
        keep: list[str] = field(default_factory=list)
        """FQNs built as QuantLinear even where ``plans`` keeps them high: quantized in a later phase of the
        schedule (titan/targets/schedule.py), or recording what-if statistics."""

    def __init__(self, config: Config):
        self.config = config

    def _layer_config(self, cfg, plan: LinearPlan):
        if plan.backends[0].startswith("torchao"):
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
        ao = torchao_config_of(cfg)
        if ao is None:
            return f"torchtitan {name}"

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


def linear_entries(config) -> dict[str, LayerShape]:
    """FQN -> shape of every linear layer the plan covers (before or after conversion); an MoE router's gate
    is a ``router`` entry: high precision unless a rule names it, as torchtitan's MoE converters keep it."""
    tp = max(1, config.parallelism.tensor_parallel_degree)
    seq = config.training.seq_len
    return {
        fqn: LayerShape(c.in_features, c.out_features, seq, tp, kind=_kind(parent))
        for fqn, c, parent, _ in linear_configs(config.model_spec.model)
    }


def _kind(parent) -> str:
    return "router" if isinstance(parent, TokenChoiceTopKRouter.Config) else "linear"


def convert_linears(config, plans: dict[str, LinearPlan], keep: set[str]) -> None:
    """Swap the linears the plan quantizes (or ``keep`` names) in ``config``'s model tree; log why layers
    torchao could compute stay emulated; hook torchao's FSDP scale precompute where torchao runs layers."""
    mine = {f: p for f, p in plans.items() if f in linear_entries(config)}
    _log_fallbacks(mine, linear_entries(config), config.quantize.backend, detect_hardware())
    converter = PrecisionPlanConverter.Config(plans=mine, torchao=config.quantize.torchao, keep=sorted(keep))
    config.model_spec.model = converter.build().convert(config.model_spec.model)
    if any(p.backends[0].startswith("torchao") for p in mine.values()):
        install_fsdp_scale_precompute(config)


def current_linears(model_config) -> dict[str, tuple[LinearPlan, str]]:
    """FQN -> (plan, module label) of every linear as the tree holds it: high precision for unconverted
    linears, all-``torchtitan`` backends for linears a torchtitan converter swapped."""
    out = {}
    for fqn, cfg, _, _ in model_config.traverse(Linear.Config):
        if type(cfg) in _ours():
            out[fqn] = (getattr(cfg, "plan", LinearPlan()), module_label(cfg))
        elif type(cfg).__module__.startswith("torchtitan.components."):
            out[fqn] = (LinearPlan(backends=("torchtitan",) * len(LinearPlan().backends)), module_label(cfg))
    return out


KIND = TargetKind(
    name="linear",
    what="a linear layer",
    switchable=True,
    entries=linear_entries,
    convert=lambda config, run: convert_linears(config, run.plans, run.keep()),
    label=lambda plans, fqn: plan_module_label(plans[fqn]),
    current=current_linears,
    converted=converted_linears,
)
"""Linear layers (router gates included) as a kind of plan target (``titan.targets.registry``)."""
