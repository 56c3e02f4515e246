"""Named precision recipes: one name sets the spec of all six GEMM operand roles of a linear layer.

The one table behind ``[quantize] recipe = ...`` and ``LinearPlan.from_recipe`` (Python users, no TOML), and the
one check of a recipe name (``recipe_specs``): adding a recipe is one entry of ``RECIPES``.

Each recipe gives a spec per operand (input, weight, grad_output); the operand's spec is used in every GEMM
it feeds, with the axis set to that GEMM's contraction dim (``nn.operands``). Conventions and their sources:

- fp8_tensorwise: torchao ``Float8LinearConfig()`` default: e4m3 input/weight, e5m2 grad_output, one fp32
  scale per tensor.
- fp8_rowwise: torchao recipe "rowwise": e4m3 everywhere, one scale per row along the contraction dim,
  power-of-two scales (``round_scales_to_power_of_2``: the dequant scale amax/max rounded up = "rceil").
- fp8_rowwise_hp_wgrad: torchao "rowwise_with_gw_hp": forward rowwise e4m3; dgrad grad_output rowwise e4m3 and
  weight tensorwise e4m3; the weight-gradient GEMM in high precision.
- deepseek_fp8: DeepSeek-V3 tech report sec. 3.3: e4m3 everywhere, weights in 128x128 tiles, activations and
  gradients in 1x128 blocks along the contraction dim, fp32 scales.
- mxfp8 / mxfp6 / mxfp4: OCP MX v1.0: 1x32 blocks along the contraction dim, e8m0 scales. mxfp8 uses torchao's
  training default scale rounding (RCEIL); mxfp6 / mxfp4 the spec's floor rule. mxfp6: e2m3 for input/weight,
  e3m2 (more range) for gradients.
- nvfp4: NVIDIA's NVFP4 training recipe (arXiv 2509.25149 sec. 4; Transformer Engine's NVFP4BlockScaling):
  e2m1, 1x16 blocks with ue4m3 scales under an fp32 tensor scale; weights in 16x16 tiles (so W and W^T share
  one quantization); a 16-point random Hadamard transform on both operands of the weight-gradient GEMM;
  gradients stochastically rounded. Ablations (one part off each): nvfp4_no_rht, nvfp4_no_sr,
  nvfp4_1d_weights (weights in 1x16 blocks along each GEMM's contraction dim); nvfp4_4over6 adds 4over6
  adaptive block scaling (MSE choice) to every role.
- nvfp4_te: ``nvfp4`` as Transformer Engine's NVFP4BlockScaling computes it (issue 38): the same roles, plus
  TE's fixed RHT sign vector on the wgrad operands (``rht_signs = "te"``) and TE's scale arithmetic on every
  role (``scale_apply = "reciprocal"``, ``scale_underflow = "zero"``, ``scale_order = "te"``); what is not
  copied: docs/precision_plan.md, "nvfp4_te".
- nvfp4_torchao: ``nvfp4`` as torchao 0.18's NVFP4 training module (``NVFP4TrainingConfig``, its Triton
  kernels) computes it: the same roles; torchao's scale arithmetic on every role (``scale_order = "torchao"``,
  ``scale_apply = "reciprocal"``, block scales floored at 2^-6: ``scale_min = "normal"``); the wgrad RHT's
  result rounded to bf16 (``rht_output``). torchao draws each layer's sign vector at random unless it is
  given one: this recipe takes TE's (pass it as ``rht_sign_vector``). Which tests stand in for torchao's
  kernels: docs/formats.md, "Equal to whom".
- fp8_block_te / fp8_block_te_exact: blockwise fp8 as Transformer Engine's Float8BlockScaling computes it
  (``Float8BlockQuantizer``): e4m3 everywhere, 1x128 blocks for activations and gradients, 128x128 weight
  tiles, fp32 scales; TE's default power-of-two scales 2^floor(log2 fl(448 / amax)) (= our "rceil") or its
  exact ones (``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``): values times fl(448 / amax), scale fl(1 / that)
  (``scale_order = "te"`` on one level, ``formats.te_order``). deepseek_fp8 divides by fl(amax / 448).
- mxfp8_2d_weights / fp8_rowwise_2d_weights: transpose-safe weights: mxfp8 with 32x32 e8m0 weight tiles,
  fp8_rowwise with 128x128 fp32 weight tiles (deepseek_fp8 is the 1x128-activation variant of the latter).
- fp8_delayed: Transformer Engine's DelayedScaling (HYBRID: e4m3 forward, e5m2 gradients; amax history of
  1024 casts, "max"): fp8_tensorwise with the tensor scale from each operand's amax history.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from low_bits_training.errors import ConfigError
from low_bits_training.formats import QuantSpec

from .operands import ROLES

_FP8_ROW = QuantSpec.fp8_rowwise(scale_rounding="rceil")
_NVFP4_TILE = QuantSpec("e2m1", "tile", block_size=16, scale_format="ue4m3", tensor_scale=True)
_NVFP4_RHT = 16
"""The RHT size of the nvfp4 recipe's weight-gradient GEMM (arXiv 2509.25149: 16 suffices at 12B scale)."""
_TE_NVFP4 = dict(scale_apply="reciprocal", scale_underflow="zero", scale_order="te")
"""The scale arithmetic of Transformer Engine's NVFP4 quantizer, on every role of ``nvfp4_te``."""
_AO_NVFP4 = dict(scale_apply="reciprocal", scale_min="normal", scale_order="torchao")
"""The scale arithmetic of torchao's NVFP4 training kernels, on every role of ``nvfp4_torchao``."""
_TE_FP8_EXACT = dict(scale_apply="reciprocal", scale_order="te")
"""TE's exact fp32 block scales (``Float8BlockQuantizer`` without power-of-two scales): ``fp8_block_te_exact``."""


def _by_operand(
    input: QuantSpec | None, weight: QuantSpec | None, grad_output: QuantSpec | None
) -> dict[str, QuantSpec | None]:
    by = {"input": input, "weight": weight, "grad_output": grad_output}
    return {r.name: by[r.operand] for r in ROLES}


def _hp_wgrad() -> dict[str, QuantSpec | None]:
    specs = _by_operand(_FP8_ROW, _FP8_ROW, _FP8_ROW)
    specs["dgrad.weight"] = QuantSpec.fp8_tensorwise(scale_rounding="rceil")
    specs["wgrad.grad_output"] = specs["wgrad.input"] = None
    return specs


def _nvfp4(
    rht: int = _NVFP4_RHT,
    sr: bool = True,
    weight_2d: bool = True,
    signs: str = "seeded",
    rht_output: str = "fp32",
    **extra,
) -> dict[str, QuantSpec | None]:
    """NVIDIA's NVFP4 recipe, or an ablation of it (each argument switches one part); ``signs`` /
    ``rht_output`` are the wgrad RHT's sign vector and result (``QuantSpec.rht_signs`` / ``rht_output``),
    ``extra`` sets the same fields on every role."""
    grad = QuantSpec.nvfp4(rounding="stochastic" if sr else "nearest", **extra)
    specs = _by_operand(
        QuantSpec.nvfp4(**extra),
        replace(_NVFP4_TILE, **extra) if weight_2d else QuantSpec.nvfp4(**extra),
        grad,
    )
    for role in ("wgrad.grad_output", "wgrad.input"):
        specs[role] = replace(specs[role], rht=rht, rht_signs=signs, rht_output=rht_output)
    return specs


def _with(specs: dict[str, QuantSpec | None], operand: str, spec: QuantSpec) -> dict[str, QuantSpec | None]:
    """``specs`` with every role of ``operand`` ("weight", ...) set to ``spec``."""
    return {r.name: spec if r.operand == operand else specs[r.name] for r in ROLES}


RECIPES: dict[str, dict[str, QuantSpec | None]] = {
    "bf16": _by_operand(None, None, None),
    "fp8_tensorwise": _by_operand(
        QuantSpec.fp8_tensorwise(), QuantSpec.fp8_tensorwise(), QuantSpec.fp8_tensorwise("e5m2")
    ),
    "fp8_rowwise": _by_operand(_FP8_ROW, _FP8_ROW, _FP8_ROW),
    "fp8_rowwise_hp_wgrad": _hp_wgrad(),
    "deepseek_fp8": _by_operand(
        QuantSpec.deepseek_act(), QuantSpec.deepseek_weight(), QuantSpec.deepseek_act()
    ),
    "fp8_block_te": _by_operand(
        *[
            f(scale_rounding="rceil")
            for f in (QuantSpec.deepseek_act, QuantSpec.deepseek_weight, QuantSpec.deepseek_act)
        ]
    ),
    "fp8_block_te_exact": _by_operand(
        *[
            f(**_TE_FP8_EXACT)
            for f in (QuantSpec.deepseek_act, QuantSpec.deepseek_weight, QuantSpec.deepseek_act)
        ]
    ),
    "mxfp8": _by_operand(*[QuantSpec.mxfp8("e4m3", "rceil")] * 3),
    "mxfp6": _by_operand(QuantSpec.mxfp6("e2m3"), QuantSpec.mxfp6("e2m3"), QuantSpec.mxfp6("e3m2")),
    "mxfp4": _by_operand(*[QuantSpec.mxfp4()] * 3),
    "nvfp4": _nvfp4(),
    "nvfp4_no_rht": _nvfp4(rht=0),
    "nvfp4_no_sr": _nvfp4(sr=False),
    "nvfp4_1d_weights": _nvfp4(weight_2d=False),
    "nvfp4_4over6": _nvfp4(four_over_six="mse"),
    "nvfp4_te": _nvfp4(signs="te", **_TE_NVFP4),
    "nvfp4_torchao": _nvfp4(signs="te", rht_output="bf16", **_AO_NVFP4),
    "mxfp8_2d_weights": _with(
        _by_operand(*[QuantSpec.mxfp8("e4m3", "rceil")] * 3),
        "weight",
        QuantSpec("e4m3", "tile", block_size=32, scale_format="e8m0", scale_rounding="rceil"),
    ),
    "fp8_rowwise_2d_weights": _with(
        _by_operand(_FP8_ROW, _FP8_ROW, _FP8_ROW), "weight", QuantSpec.deepseek_weight(scale_rounding="rceil")
    ),
    "fp8_delayed": _by_operand(
        QuantSpec.fp8_tensorwise(amax_history=1024),
        QuantSpec.fp8_tensorwise(amax_history=1024),
        QuantSpec.fp8_tensorwise("e5m2", amax_history=1024),
    ),
    "int8": _by_operand(*[QuantSpec.int8_rowwise()] * 3),
}
"""Recipe name -> spec per role name ("forward.input", ...); None is high precision."""

RecipeName = Literal[tuple(RECIPES)]  # type: ignore[valid-type]  # the names, read from the one table
"""A recipe name (``Literal`` of ``RECIPES``' keys: what ``[quantize] recipe`` accepts, tyro's choices)."""


def recipe_specs(name: str, where: str = "quantize.recipe") -> dict[str, QuantSpec | None]:
    """The role -> spec table of a named recipe: the one check of a recipe name (the plan, lbt-doctor,
    lbt-speed, what-if, the autopilot and ``LinearPlan.from_recipe`` all ask here).

    Args:
        name: a key of ``RECIPES``.
        where: the key the name was given under, for the message.

    Raises:
        ConfigError: an unknown name (one line listing the names).
    """
    if name not in RECIPES:
        raise ConfigError(f"{where} = {name!r}: expected one of {', '.join(RECIPES)}")
    return dict(RECIPES[name])
