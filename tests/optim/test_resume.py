"""Resume exactness: an optimizer restored mid-run from its (flat, torchtitan/DCP) state dict continues
bit for bit like one that was never interrupted, for every state format and master-weight rounding."""

from __future__ import annotations

import copy

import pytest
import torch
from optim_helpers import SHAPES, params, run
from torchtitan.components.optimizer.utils import (
    get_flat_optim_state_dict,
    init_optim_state,
    load_flat_optim_state_dict,
)

from low_bits_training.optim import LowBitAdamW, LowBitSGD

CASES = {
    "fp32": dict(exp_avg="fp32", exp_avg_sq="fp32"),
    "bf16": dict(exp_avg="bf16", exp_avg_sq="bf16"),
    "int8_e4m3": dict(exp_avg="int8_block128", exp_avg_sq="e4m3_block128"),
    "int4_e2m1": dict(exp_avg="int4_block128", exp_avg_sq="e2m1_block128"),
    "e8m0_scales_sr": dict(exp_avg="e2m1_block32_e8m0_sr", exp_avg_sq="e4m3_block32_e8m0_sr"),
    "master_bf16_sr": dict(master_weights="bf16", master_rounding="stochastic"),
    "master_bf16_kahan": dict(master_weights="bf16", master_rounding="kahan"),
    "master_e4m3_block_sr": dict(master_weights="e4m3_block128", master_rounding="stochastic"),
}


def _build(cls, ps, kw):
    base = {"lr": 1e-2, "weight_decay": 0.1, "min_quantized_numel": 0, "seed": 7, "fused": False}
    return cls([{"params": ps, "param_names": [f"layer.{i}.w" for i in range(len(ps))]}], **base, **kw)


def _resumed(cls, kw, total: int, cut: int, dtype=torch.float32) -> tuple[list[torch.Tensor], LowBitAdamW]:
    ps = params(dtype=dtype)
    opt = _build(cls, ps, kw)
    run(opt, ps, range(cut))
    flat = copy.deepcopy(get_flat_optim_state_dict(opt))  # what DCP saves
    saved = [p.detach().clone() for p in ps]
    ps2 = params(seed=99, dtype=dtype)  # a fresh process: other weights
    opt2 = _build(cls, ps2, kw)
    init_optim_state(opt2)  # torchtitan's container does this before DCP loads into the states
    with torch.no_grad():
        for p, s in zip(ps2, saved, strict=True):
            p.copy_(s)
    load_flat_optim_state_dict(opt2, flat)
    run(opt2, ps2, range(cut, total))
    return ps2, opt2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_adamw_resume_is_bit_exact(case, dtype):
    # bf16 parameters (the lean preset's): torch's load casts each floating state to the parameter's dtype;
    # fp32 block scales and the fp32 moments of small parameters must come back as saved (issue 40)
    kw = CASES[case]
    ps = params(dtype=dtype)
    opt = _build(LowBitAdamW, ps, kw)
    run(opt, ps, range(6))
    ps2, opt2 = _resumed(LowBitAdamW, kw, 6, 3, dtype)
    for a, b in zip(ps, ps2, strict=True):
        assert torch.equal(a, b)
    for p, q in zip(ps, ps2, strict=True):
        for k, v in opt.state[p].items():
            assert opt2.state[q][k].dtype == v.dtype and torch.equal(opt2.state[q][k], v), k


def test_sgd_resume_is_bit_exact():
    kw = dict(momentum_buffer="int8_block128_sr", master_weights="bf16", master_rounding="stochastic")
    ps = params()
    run(_build(LowBitSGD, ps, kw), ps, range(6))
    ps2, _ = _resumed(LowBitSGD, kw, 6, 3)
    for a, b in zip(ps, ps2, strict=True):
        assert torch.equal(a, b)


def test_stochastic_streams_depend_on_seed_and_step():
    kw = CASES["master_bf16_sr"]
    a, b = params(), params()
    run(_build(LowBitAdamW, a, kw), a, range(2))
    opt = LowBitAdamW(
        [{"params": b, "param_names": [f"layer.{i}.w" for i in range(len(SHAPES))]}],
        lr=1e-2,
        weight_decay=0.1,
        min_quantized_numel=0,
        seed=8,
        fused=False,
        **kw,
    )
    run(opt, b, range(2))
    assert not torch.equal(a[0], b[0])


def test_master_weights_stay_on_their_grid():
    for kw, fmt in [(CASES["master_bf16_sr"], torch.bfloat16), (CASES["master_bf16_kahan"], torch.bfloat16)]:
        ps = params()
        run(_build(LowBitAdamW, ps, kw), ps, range(3))
        for p in ps:
            assert torch.equal(p.detach().to(fmt).float(), p.detach())
