"""Bases whose model already carries torchtitan's own converters (for the converter-aware plan tests)."""

from torchtitan.components.quantization import Float8LinearConverter
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel


def debugmodel_float8_emulate():
    """llama3_debugmodel with torchtitan's Float8LinearConverter (emulate) on every linear."""
    config = llama3_debugmodel()
    config.model_spec = model_registry("debugmodel", converters=[Float8LinearConverter.Config(emulate=True)])
    return config


def debugmodel_float8_attention_only():
    """llama3_debugmodel with torchtitan's Float8 converter (emulate) on the attention linears only."""
    config = llama3_debugmodel()
    skip = ["feed_forward", "lm_head"]
    converter = Float8LinearConverter.Config(emulate=True, filter_fqns=skip)
    config.model_spec = model_registry("debugmodel", converters=[converter])
    return config
