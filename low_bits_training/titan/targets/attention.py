"""Attention GEMMs inside the precision plan: the quantized inner attention and its converter.

torchtitan 0.3's attention modules (``GQAttention``, ``layers.N.attention``) hand Q, K, V to an inner
attention (``.inner_attention``, FlexAttention for the llama3 and qwen3 bases). The plan names the two
products of each ``<fqn>.qk`` / ``<fqn>.pv`` (``plan.attention``, ``nn.attention``). Where the plan
quantizes one of them, ``convert_attention`` swaps the inner attention for ``QuantFlexAttention``: the
FlexAttention interface and BlockMask, computed with the mask made dense (as the CPU adapter does) by
``nn.attention.quant_attention``. Where it does not, nothing changes: the same module, the same numbers.
Emulated on every device (no fp8 attention kernel is used, even on a GPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields

from torchtitan.models.common.attention import BaseAttention, FlexAttention

from low_bits_training.errors import ConfigError
from low_bits_training.nn import LinearPlan
from low_bits_training.nn.attention import PRODUCTS, AttentionPlan, ProductState, quant_attention
from low_bits_training.plan.attention import check_attention_parallelism
from low_bits_training.plan.resolve import LayerShape
from low_bits_training.titan.platform import cpu
from low_bits_training.titan.targets.kind import TargetKind, TitanQuantState


class TitanProductState(ProductState, TitanQuantState):
    """``ProductState`` under torchtitan's Module protocol (``titan.targets.kind.TitanQuantState``)."""


@functools.cache
def quant_attention_class() -> type:
    """``QuantFlexAttention``, built on first use (its base is the CPU adapter's dense-mask attention)."""
    dense = cpu._dense_attention_class()

    class QuantFlexAttention(dense):
        """FlexAttention's interface and BlockMask; attention by ``quant_attention`` under the plan."""

        @dataclass(kw_only=True, slots=True)
        class Config(dense.Config):
            plans: dict[str, LinearPlan] = field(default_factory=dict)
            """Plan of each product: ``{"qk": ..., "pv": ...}``."""
            fqn: str = ""
            """The attention module's FQN (keys each product's stochastic-rounding stream)."""

        def __init__(self, config: Config):
            super().__init__(config)
            for n in PRODUCTS:
                self.add_module(n, TitanProductState(config.plans.get(n, LinearPlan()), f"{config.fqn}.{n}"))
            self.replan()
            for n in PRODUCTS:
                getattr(self, n).on_plan = self.replan

        def replan(self) -> None:
            """The module's ``AttentionPlan`` from its products' plans (again after a phase or the autopilot
            changed one: the plan is a graph constant, so a compiled block compiles once per distinct plan)."""
            self.plan = AttentionPlan(qk=self.qk.plan, pv=self.pv.plan)

        def attend(self, q, k, v, mask, scale, enable_gqa):
            states = (self.qk.state, self.pv.state)
            return quant_attention(q, k, v, self.plan, mask=mask, scale=scale, states=states)

    return QuantFlexAttention


def _attentions(model_config) -> list:
    """``(fqn, config)`` of the attention modules whose inner attention is a FlexAttention (the ones the plan
    covers)."""
    return [
        (fqn, cfg)
        for fqn, cfg, _, _ in model_config.traverse(BaseAttention.Config)
        if isinstance(getattr(cfg, "inner_attention", None), FlexAttention.Config)
    ]


def attention_layers(model_config, seq_len: int) -> dict[str, LayerShape]:
    """The plan entries of every covered attention module: ``<fqn>.qk`` / ``<fqn>.pv`` -> their shape as
    a linear layer (``plan.attention``)."""
    out = {}
    for fqn, cfg in _attentions(model_config):
        h = getattr(cfg, "head_dim", None) or cfg.dim // cfg.n_heads
        out[f"{fqn}.qk"] = LayerShape(h, seq_len, seq_len, kind="qk", copies=cfg.n_heads)
        out[f"{fqn}.pv"] = LayerShape(seq_len, h, seq_len, kind="pv", copies=cfg.n_heads)
    return out


TRANSIENT = 4
"""Dense (B, N, L, S) fp32 tensors alive at once inside one quantized attention's forward or backward besides
the saved probabilities: the scores, their masked copy, a cast operand and a product (backward: dP, its
cast, dS and its cast)."""


def _heads(config) -> int:
    return max((cfg.n_heads for _, cfg in _attentions(config.model_spec.model)), default=0)


def dense_bytes(config, modules: int) -> tuple[int, int]:
    """``(bytes of one (B, N, L, S) fp32 matrix, bytes at the peak)`` of ``modules`` quantized attention
    modules on one rank: each keeps its probabilities P for the backward (one at a time under full
    activation checkpointing, which recomputes them), plus ``TRANSIENT`` such matrices while one runs. B is
    the microbatch (``training.local_batch_size``), N the query heads, L = S = ``training.seq_len``."""
    t = config.training
    one = t.local_batch_size * _heads(config) * t.seq_len * t.seq_len * 4
    kept = 1 if type(config.activation_checkpoint).__qualname__ == "FullAC.Config" else modules
    return one, one * (kept + TRANSIENT)


def check_attention_memory(config, plans: dict[str, LinearPlan], memory: int) -> None:
    """Refuse a plan whose quantized attention cannot hold its dense fp32 matrices in ``memory`` bytes (the
    device's, as torchtitan's device module gives it): quantized attention computes softmax(Q K^T) V with
    the whole (B, N, L, S) matrix, as SDPA's math path does, not in blocks.

    Raises:
        ConfigError: the estimate (``dense_bytes``) passes ``memory``; one line with the sizes and the ways out.
    """
    bases = {
        f.rsplit(".", 1)[0] for f, p in plans.items() if f.endswith(PRODUCTS) and not p.is_high_precision
    }
    mine = [fqn for fqn, _ in _attentions(config.model_spec.model) if fqn in bases]
    if not mine or memory <= 0:
        return
    one, peak = dense_bytes(config, len(mine))
    if peak <= memory:
        return
    t, gb = config.training, 1e9
    raise ConfigError(
        f"quantize: {len(mine)} quantized attention modules keep a dense fp32 (batch x heads x seq x seq) matrix "
        f"each: {t.local_batch_size} x {_heads(config)} x {t.seq_len} x "
        f"{t.seq_len} x 4 B = {one / gb:.1f} GB, about {peak / gb:.1f} GB at the backward's peak, more than this "
        f"device's {memory / gb:.1f} GB; lower training.seq_len or training.local_batch_size, use "
        "activation_checkpoint full, or leave the attention products (layers.*.attention.qk / .pv) in high precision"
    )


UNCHANGED = "FlexAttention"
"""The module label of attention the plan leaves alone (FlexAttention, or the CPU adapter's dense-mask one)."""


def product_module_label(plans: dict[str, LinearPlan], fqn: str) -> str:
    """What ``convert_attention`` builds for the module of product ``fqn`` under the resolved ``plans``
    (plan table, lbt-doctor): ``QuantAttention`` where either product of the module is quantized."""
    base = fqn.rsplit(".", 1)[0]
    mine = [plans[f"{base}.{n}"] for n in PRODUCTS if f"{base}.{n}" in plans]
    return UNCHANGED if all(p.is_high_precision for p in mine) else "QuantAttention"


def attention_plans(model_config) -> dict[str, tuple[LinearPlan, str]]:
    """Every product's plan as it stands in the model config tree, and the module that runs it."""
    out = {}
    for fqn, cfg in _attentions(model_config):
        inner = cfg.inner_attention
        plans = getattr(inner, "plans", {})
        label = "QuantAttention" if plans else UNCHANGED
        out.update({f"{fqn}.{n}": (plans.get(n, LinearPlan()), label) for n in PRODUCTS})
    return out


def convert_attention(
    model_config, plans: dict[str, LinearPlan], parallelism, keep: set[str] = frozenset()
) -> int:
    """Swap the inner attention of every attention module the plan quantizes, or whose product ``keep`` names
    (quantized in a later phase: such a module starts on its step-1 plans, high precision on the dense path),
    in place.

    Returns:
        How many were swapped.

    Raises:
        ConfigError: quantized attention under tensor or context parallelism.
    """
    cls = quant_attention_class()
    hits = []
    for fqn, cfg in _attentions(model_config):
        mine = {n: plans[f"{fqn}.{n}"] for n in PRODUCTS if f"{fqn}.{n}" in plans}
        later = any(f"{fqn}.{n}" in keep for n in PRODUCTS)
        if later or not all(p.is_high_precision for p in mine.values()):
            hits.append((fqn, cfg, mine))
    check_attention_parallelism([f for f, _, _ in hits], parallelism)
    for fqn, cfg, mine in hits:
        old = cfg.inner_attention
        base = {f.name: getattr(old, f.name) for f in fields(FlexAttention.Config)}
        cfg.inner_attention = cls.Config(**base, plans=mine, fqn=fqn)
    return len(hits)


KIND = TargetKind(
    name="attention",
    what="an attention product",
    switchable=True,
    entries=lambda config: attention_layers(config.model_spec.model, config.training.seq_len),
    convert=lambda config, run: convert_attention(
        config.model_spec.model, run.plans, config.parallelism, run.keep()
    ),
    label=product_module_label,
    current=attention_plans,
)
"""Attention products (Q K^T, P V) as a kind of plan target (``titan.targets.registry``)."""
