"""Base configs of our own, for ``[job] base = "low_bits_training.titan.launch.bases:<name>"``: the one
registry of them (``__all__``; ``tests/titan/launch/test_base_registry.py`` holds every preset that names one of ours
to it).

torchtitan 0.3.0 ships config functions for the Llama 3 debug model, 8B, 70B and 405B; the 1B (Llama 3.2)
flavor exists in its model registry but has no config function, so it is here. ``qwen3_moe_tiny`` is
torchtitan's Qwen3-MoE debug recipe cut to a size that trains on a CPU.
"""

from __future__ import annotations

from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.common.feed_forward import compute_ffn_hidden_dim
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_8b, llama3_debugmodel
from torchtitan.models.qwen3.config_registry import qwen3_moe_debug
from torchtitan.models.qwen3.model import Qwen3Model
from torchtitan.trainer import Trainer

from low_bits_training.titan.platform.compat import llama3_builders, qwen3_builders

__all__ = ["llama3_100m", "llama3_1b", "llama3_narrow", "llama3_tiny", "qwen3_moe_tiny"]
"""Every base of ours, by the name ``[job] base`` gives after ``low_bits_training.titan.launch.bases:``."""


def llama3_1b() -> Trainer.Config:
    """Llama 3.2 1B: the 8B recipe (AdamW, c4, selective AC) on the 1B architecture."""
    config = llama3_8b()
    config.model_spec = model_registry("1B")
    config.loss.loss_fn.global_vocab_size = decoder_vocab_size(config.model_spec)
    config.hf_assets_path = "./assets/hf/Llama-3.2-1B"
    return config


def llama3_tiny() -> Trainer.Config:
    """The debug model cut to its first 2 layers: the fastest real Llama 3 for smoke tests on CPU."""
    config = llama3_debugmodel()
    config.model_spec.model.layers = config.model_spec.model.layers[:2]
    return config


def llama3_narrow() -> Trainer.Config:
    """The debug model at width 128 (8 heads of 16, FFN 512) with 2 blocks: about a third of ``llama3_tiny``'s
    cost per token, for CPU studies that need hundreds of steps and several seeds (benchmarks/nvfp4_ablation.py).
    """
    config = llama3_debugmodel()
    _resize(config, n_layers=2, dim=128, heads=8)
    return config


def llama3_100m() -> Trainer.Config:
    """A Llama 3 of about 88M parameters (12 blocks of width 768, 12 heads of 64, FFN 2048, the debug model's
    2048-token vocabulary): the ~100M shape the memory planner is held to beside the debug model
    (``tests/titan/runtime/test_peak.py``)."""
    config = llama3_debugmodel()
    _resize(config, n_layers=12, dim=768, heads=12)
    return config


def _resize(config: Trainer.Config, n_layers: int, dim: int, heads: int) -> None:
    """The debug model of ``config`` rebuilt with ``n_layers`` blocks of width ``dim`` (``heads`` heads, FFN as
    Llama 3 sizes it) by the pinned torchtitan 0.3.0's own llama3 block builder (``compat.llama3_builders``, the
    one its flavors use): inits, RoPE (the debug model's, at the head width) and attention are the debug model's.
    """
    import dataclasses

    model = config.model_spec.model
    rope = dataclasses.replace(model.layers[0].attention.rope, dim=dim // heads)
    build_layers, output_init = llama3_builders()
    layers = build_layers(
        n_layers=n_layers, dim=dim, n_heads=heads, hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=256),
        rope=rope, attn_backend="flex",
    )  # fmt: skip
    config.model_spec.model = dataclasses.replace(
        model,
        dim=dim,
        tok_embeddings=dataclasses.replace(model.tok_embeddings, embedding_dim=dim),
        norm=dataclasses.replace(model.norm, normalized_shape=dim),
        lm_head=dataclasses.replace(model.lm_head, in_features=dim, param_init=output_init(dim)),
        layers=layers,
    )


def _tiny_moe_model(n_layers: int, dim: int, experts: int, top_k: int, hidden: int, vocab: int):
    # torchtitan's own builders (models/qwen3/__init__.py) at a size that trains on a laptop CPU.

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
    config = qwen3_moe_debug()
    config.model_spec.model = _tiny_moe_model(4, 128, 8, 2, 128, 2048)
    config.model_spec.flavor = "tiny_moe"
    config.loss.loss_fn.global_vocab_size = decoder_vocab_size(config.model_spec)
    return config
