"""The precision plan inside torchtitan: QuantLinear as a config-tree module, the converter, the plan table.

torchtitan 0.3 builds the model from a config tree; its llama3 linears are ``Linear.Config`` entries
(models/common/linear.py). Like torchtitan's own ``Float8LinearConverter`` (components/quantization/float8.py),
``PrecisionPlanConverter`` replaces the selected entries with ``TitanQuantLinear.Config`` before the model is
built. Parameters and state_dict keys stay those of ``nn.Linear``, so checkpoints move between recipes.
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

from low_bits_training.config.plan import LayerShape, resolve_plan
from low_bits_training.config.plan_table import format_plan, plan_to_json
from low_bits_training.nn import LinearPlan, QuantLinear


class TitanQuantLinear(QuantLinear, Module):
    """``QuantLinear`` that satisfies torchtitan's Module protocol (param init, sharding config)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        """``Linear.Config`` plus the layer's precision plan."""

        plan: LinearPlan = field(default_factory=LinearPlan)
        """Spec per GEMM operand role and backend per GEMM (see ``low_bits_training.nn.roles``)."""

    def __init__(self, config: Config):
        QuantLinear.__init__(
            self, config.in_features, config.out_features, bias=config.bias, plan=config.plan
        )


class PrecisionPlanConverter(QuantizationConverter):
    """Swap ``Linear.Config`` entries for ``TitanQuantLinear.Config`` where the plan quantizes something."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        plans: dict[str, LinearPlan] = field(default_factory=dict)
        """Resolved plan: linear-layer FQN -> LinearPlan (see ``config.plan.resolve_plan``)."""

    def __init__(self, config: Config):
        self.config = config

    def convert(self, model_config):
        hits = [h for h in linear_configs(model_config) if not self.config.plans[h[0]].is_high_precision]
        for fqn, cfg, parent, attr in hits:
            new = TitanQuantLinear.Config(
                in_features=cfg.in_features,
                out_features=cfg.out_features,
                bias=cfg.bias,
                param_init=cfg.param_init,
                sharding_config=cfg.sharding_config,
                plan=self.config.plans[fqn],
            )
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        logger.info(f"Precision plan: {len(hits)} linear layers quantized")
        return model_config


def linear_configs(model_config) -> list:
    """``(fqn, config, parent, attr)`` of the plain linears the plan covers (exactly ``Linear.Config``, or
    an already converted ``TitanQuantLinear.Config``; specialised subclasses keep their own forward)."""
    kinds = (Linear.Config, TitanQuantLinear.Config)
    return [h for h in model_config.traverse(Linear.Config) if type(h[1]) in kinds]


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def apply_precision_plan(config) -> dict[str, LinearPlan]:
    """Validate ``config.quantize`` against the model and rewrite the model config tree in place.

    Args:
        config: the ``LowBitsTrainer.Config`` (its ``model_spec.model`` is replaced).

    Returns:
        FQN -> LinearPlan for every covered linear layer.

    Raises:
        ConfigError: one line, before the model is built (see ``config.plan.resolve_plan``).
    """
    model = config.model_spec.model
    tp = max(1, config.parallelism.tensor_parallel_degree)
    layers = {
        fqn: LayerShape(c.in_features, c.out_features, config.training.seq_len, tp)
        for fqn, c, _, _ in linear_configs(model)
    }
    plans = resolve_plan(config.quantize, layers, _device())
    converter = PrecisionPlanConverter.Config(plans=plans).build()
    config.model_spec.model = converter.convert(model)
    return plans


def current_plans(config) -> dict[str, LinearPlan]:
    """The plan as it stands in the model config tree (high precision for unconverted linears)."""
    return {fqn: getattr(c, "plan", LinearPlan()) for fqn, c, _, _ in linear_configs(config.model_spec.model)}


def save_plan(config, folder: str | os.PathLike) -> Path:
    """Write ``precision_plan.txt`` (the table) and ``precision_plan.json`` into ``folder``; log the table.

    Returns:
        The path of the text table.
    """
    plans = current_plans(config)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = f"recipe={config.quantize.recipe} backend={config.quantize.backend}\n" + format_plan(plans)
    (folder / "precision_plan.txt").write_text(text)
    (folder / "precision_plan.json").write_text(json.dumps(plan_to_json(plans), indent=1) + "\n")
    logger.info("Precision plan:\n" + text)
    return folder / "precision_plan.txt"
