"""Base configs of our own, for ``[job] base = "low_bits_training.titan.bases:<name>"``.

torchtitan 0.3.0 ships config functions for the Llama 3 debug model, 8B, 70B and 405B; the 1B (Llama 3.2)
flavor exists in its model registry but has no config function, so it is here.
"""

from __future__ import annotations

from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_8b
from torchtitan.trainer import Trainer


def llama3_1b() -> Trainer.Config:
    """Llama 3.2 1B: the 8B recipe (AdamW, c4, selective AC) on the 1B architecture."""
    config = llama3_8b()
    config.model_spec = model_registry("1B")
    config.loss.loss_fn.global_vocab_size = decoder_vocab_size(config.model_spec)
    config.hf_assets_path = "./assets/hf/Llama-3.2-1B"
    return config


def llama3_tiny() -> Trainer.Config:
    """The debug model cut to its first 2 layers: the fastest real Llama 3 for smoke tests on CPU."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    config.model_spec.model.layers = config.model_spec.model.layers[:2]
    return config
