"""Accuracy of every recipe against the fp32 computation: forward output, grad_input, grad_weight.

Floors were measured (``operands()``: 256 tokens, 256 -> 384, a few 5x outlier channels) and set ~1 dB under
the lowest of fp32/bf16 inputs. A ceiling (floor + 6 dB) catches a cast that silently stopped quantizing.
"""

import pytest
import torch
from nn_helpers import linear_grads, operands, plan_for, sqnr_db

from low_bits_training.nn.recipes import RECIPES

# recipe: (output, grad_input, grad_weight) SQNR floors in dB; None: high precision (no ceiling).
FLOORS = {
    "fp8_tensorwise": (27.5, 23.5, 23.5),  # e5m2 gradients: 2 mantissa bits
    "fp8_rowwise": (27.5, 27.5, 27.5),
    "fp8_rowwise_hp_wgrad": (27.5, 27.5, None),
    "deepseek_fp8": (28.0, 27.5, 27.5),
    "mxfp8": (27.5, 27.5, 27.5),
    "mxfp6": (26.0, 23.5, 23.5),  # e3m2 gradients
    "mxfp4": (13.8, 14.8, 14.8),
    "nvfp4": (15.8, 14.0, 14.3),  # RHT on wgrad: no SQNR gain on these operands (docs/precision_plan.md)
    "nvfp4_no_rht": (15.8, 14.0, 14.5),
    "nvfp4_no_sr": (15.8, 15.7, 16.4),
    "nvfp4_1d_weights": (16.5, 14.5, 14.3),
    "nvfp4_4over6": (15.9, 14.2, 14.9),
    "nvfp4_te": (15.8, 14.0, 14.3),  # TE's scale arithmetic and signs: nvfp4's SQNR to 0.1 dB
    "nvfp4_torchao": (
        15.8,
        14.0,
        14.3,
    ),  # torchao's arithmetic, 2^-6 floor, bf16 rotations: nvfp4's to 0.1 dB
    "fp8_block_te": (27.5, 27.5, 27.5),  # power-of-two block scales: 0.2-0.7 dB under deepseek_fp8
    "fp8_block_te_exact": (28.0, 27.5, 27.5),  # TE's encode-first scales: deepseek_fp8's SQNR to 0.01 dB
    "mxfp8_2d_weights": (27.5, 27.5, 27.5),
    "fp8_rowwise_2d_weights": (27.5, 27.5, 27.5),
    "fp8_delayed": (27.5, 23.5, 23.5),  # one call: an empty history scales as current scaling
    "int8": (34.0, 38.5, 39.0),
}
HP_FLOOR = {torch.float32: 120.0, torch.bfloat16: 50.0}


def test_every_recipe_has_a_floor():
    assert set(FLOORS) | {"bf16"} == set(RECIPES)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", sorted(FLOORS))
def test_sqnr_floor(recipe, dtype):
    x, w, dy = operands(dtype=dtype)
    ref = linear_grads(x.float(), w.float(), dy.float(), None)
    got = linear_grads(x, w, dy, plan_for(recipe))
    for name, g, r, floor in zip(
        ("output", "grad_input", "grad_weight"), got, ref, FLOORS[recipe], strict=True
    ):
        s = sqnr_db(g, r)
        lo = HP_FLOOR[dtype] if floor is None else floor
        assert s >= lo, f"{recipe} {name} {dtype}: SQNR {s:.1f} dB < floor {lo}"
        if floor is not None:
            assert s <= floor + 6, f"{recipe} {name} {dtype}: SQNR {s:.1f} dB: is it still quantizing?"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_recipe_is_plain_linear(dtype):
    x, w, dy = operands(dtype=dtype)
    got = linear_grads(x, w, dy, plan_for("bf16"))
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = torch.nn.functional.linear(xg, wg)
    y.backward(dy)
    for a, b in zip(got, (y.detach(), xg.grad, wg.grad), strict=True):
        assert torch.equal(a, b)


def test_finer_formats_are_more_accurate():
    x, w, dy = operands()
    ref = linear_grads(x, w, dy, None)
    s = {
        r: sqnr_db(linear_grads(x, w, dy, plan_for(r))[0], ref[0])
        for r in ("mxfp4", "mxfp6", "mxfp8", "int8")
    }
    assert s["mxfp4"] + 8 < s["mxfp6"] < s["mxfp8"] + 2 < s["int8"]
