"""GEMM targets of a decoder from its dimensions (no torchtitan): the published setups the model is held
against, and a quick way to ask the model about a shape without a run config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from low_bits_training.nn.roles import LinearPlan

from .model import GemmTarget

PlanOf = Callable[[str, int], LinearPlan]
"""(linear name, block index; -1 for the output layer ``lm_head``) -> its plan."""


@dataclass(frozen=True)
class Decoder:
    """The GEMM-relevant dimensions of a decoder-only transformer."""

    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    linears: tuple[tuple[str, int, int], ...]
    """(name inside a block, in_features, out_features) of each linear of one block."""
    vocab: int = 0
    """Output-layer width (0: no output layer among the targets)."""


def llama3(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, ffn: int, vocab: int) -> Decoder:
    """A Llama 3 decoder with torchtitan 0.3's linear names (fused ``wqkv``, SwiGLU ``w1``/``w2``/``w3``)."""
    hd = dim // n_heads
    linears = (
        ("attention.qkv_linear.wqkv", dim, (n_heads + 2 * n_kv_heads) * hd),
        ("attention.wo", n_heads * hd, dim),
        ("feed_forward.w1", dim, ffn),
        ("feed_forward.w2", ffn, dim),
        ("feed_forward.w3", dim, ffn),
    )
    return Decoder(dim, n_layers, n_heads, hd, linears, vocab)


LLAMA3_8B = llama3(4096, 32, 32, 8, 14336, 128256)
"""Llama 3.1 8B (torchtitan's ``llama3_8b``)."""
TE_5B = Decoder(
    4096,
    24,
    32,
    128,
    (("qkv", 4096, 12288), ("proj", 4096, 4096), ("fc1", 4096, 16384), ("fc2", 16384, 4096)),
)
"""The 5B model of Transformer Engine's GEMM profiling tutorial (hidden 4096, MLP 16384, 24 layers)."""


def recipe_plans(recipe: str, bf16_blocks: set[int] = frozenset()) -> PlanOf:
    """Every block linear with ``recipe``'s plan, except the blocks in ``bf16_blocks`` and the output layer
    (kept in bf16, as torchao, torchtitan and Transformer Engine keep it)."""
    quant, high = LinearPlan.from_recipe(recipe), LinearPlan()
    return lambda name, block: quant if block >= 0 and block not in bf16_blocks else high


def decoder_targets(
    model: Decoder,
    batch: int,
    seq: int,
    plan_of: PlanOf,
    recompute: float = 0.0,
    weight_share: float = 1.0,
    attention: bool = True,
) -> list[GemmTarget]:
    """Every GEMM target of one step of ``model`` on one GPU.

    Args:
        model: the dimensions.
        batch: sequences per GPU per step; ``seq``: their length.
        plan_of: the plan of each linear (``recipe_plans``).
        recompute: extra forward passes of the linears (activation checkpointing: 0.5 for torchtitan's
            per-op selective AC, which recomputes every second matmul; 1.0 for full AC).
        weight_share: share of each weight this GPU casts (1/dp under FSDP's fp8 all-gather).
        attention: add the attention products (causal, bf16; flash attention recomputes Q K^T).

    Returns:
        The targets, block by block, then the output layer.
    """
    tokens, out = batch * seq, []
    for i in range(model.n_layers):
        for name, k, n in model.linears:
            plan = plan_of(name, i)
            share = weight_share if not plan.is_high_precision else 1.0
            out.append(
                GemmTarget(f"layers.{i}.{name}", k, n, tokens, plan, recompute=recompute, weight_share=share)
            )
        if attention:
            out += _attention(f"layers.{i}.attention", model, batch, seq)
    if model.vocab:
        out.append(
            GemmTarget("lm_head", model.dim, model.vocab, tokens, plan_of("lm_head", -1), recompute=recompute)
        )
    return out


def _attention(fqn: str, model: Decoder, batch: int, seq: int) -> list[GemmTarget]:
    count, hd = batch * model.n_heads, model.head_dim
    return [
        GemmTarget(f"{fqn}.qk", hd, seq, seq, kind="qk", count=count, causal=0.5, recompute=1.0),
        GemmTarget(f"{fqn}.pv", seq, hd, seq, kind="pv", count=count, causal=0.5),
    ]
