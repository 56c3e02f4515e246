"""The dynamic-tree codebooks (dt8 / udt8) as LowBitAdamW state formats: stored codes equal torchao's 8-bit
quantizer's, fused equals eager bit for bit, resume is exact, the byte model counts 1 + 4/256 bytes, and bad
choices give one line."""

from __future__ import annotations

import copy

import pytest
import torch
from optim_helpers import adamw, params, run
from torchao.optim.quant_utils import create_dynamic_map, quantize_8bit_with_qmap, scale_tensor

from low_bits_training.formats import dequantize, quantize
from low_bits_training.optim import StateCodec, parse_state_format
from low_bits_training.optim.budget import state_bytes

DT = dict(exp_avg="dt8_block256", exp_avg_sq="udt8_block256", min_quantized_numel=0)


def _qmap(signed: bool) -> torch.Tensor:
    return torch.tensor(create_dynamic_map(signed=signed), dtype=torch.float32)


def test_first_step_codes_equal_torchao_quantizer():
    # after one step from zero states: m = (1 - b1) g and sqrt(v) = sqrt((1 - b2) g^2), computed as the
    # optimizer does (fp32, one rounding per op); its stored codes and scales are torchao's of these values
    ps = params()
    opt = adamw(ps, **DT, sqrt_exp_avg_sq=True)
    run(opt, ps, range(1))
    p, g = ps[0], ps[0].grad.float()
    m = (g - 0.0) * (1 - 0.9)
    sqrt_v = ((g * g) * (1 - 0.95)).double().sqrt().float()
    for name, x, signed in (("exp_avg", m, True), ("exp_avg_sq", sqrt_v, False)):
        scaled, scale = scale_tensor(x, 256)
        codes = quantize_8bit_with_qmap(scaled, _qmap(signed))
        assert torch.equal(opt.state[p][f"{name}_codes"].reshape(-1), codes.reshape(-1)), name
        assert torch.equal(opt.state[p][f"{name}_scales"].reshape(-1), scale), name


def test_fused_update_equals_eager_bit_for_bit():
    # one compile: signed dt8 with stochastic rounding for m, unsigned udt8 nearest for sqrt(v)
    kw = dict(DT, exp_avg="dt8_block256_sr")
    results = []
    for fused in (False, True):
        ps = params()
        opt = adamw(ps, **kw, fused=fused)
        opt.chunk_numel = 4096  # several chunks per parameter
        run(opt, ps, range(3))
        results.append((ps, opt))
    (pe, oe), (pf, of) = results
    for p, q in zip(pe, pf, strict=True):
        assert torch.equal(p, q)
        for k, v in oe.state[p].items():
            assert of.state[q][k].dtype == v.dtype and torch.equal(of.state[q][k], v), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_resume_is_bit_exact(dtype):
    ps = params(dtype=dtype)
    opt = adamw(ps, **DT)
    run(opt, ps, range(5))
    ps2 = params(dtype=dtype)
    opt2 = adamw(ps2, **DT)
    run(opt2, ps2, range(3))
    saved = copy.deepcopy(opt2.state_dict())
    ps3 = params(seed=5, dtype=dtype)
    with torch.no_grad():
        for p, q in zip(ps3, ps2, strict=True):
            p.copy_(q)
    opt3 = adamw(ps3, **DT)
    opt3.load_state_dict(saved)
    run(opt3, ps3, range(3, 5))
    for a, b in zip(ps, ps3, strict=True):
        assert torch.equal(a, b)
    for p, q in zip(ps, ps3, strict=True):
        for k, v in opt.state[p].items():
            assert opt3.state[q][k].dtype == v.dtype and torch.equal(opt3.state[q][k], v), k


def test_dynamic_tree_keeps_small_entries_of_m_that_int8_flushes():
    # the reason for the map: entries far below their block's max keep their relative precision (issue 40:
    # int8 flushes 0.9% of m to zero); here blocks of magnitudes over 5 decades, through the optimizer's codec
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=g) * torch.logspace(-5, 0, 256)[torch.randperm(256, generator=g)]
    r = x.abs() / x.abs().amax(-1, keepdim=True)
    small = (r > 1e-5) & (r < 1e-2)  # dt8's smallest magnitude is 5.5e-7 of the block max
    errs = {}
    for name in ("dt8_block256", "int8_block256"):
        codec = StateCodec(parse_state_format(name))
        y = codec.decode(codec.encode(x), tuple(x.shape))
        errs[name] = (((y - x).abs() / x.abs())[small].median().item(), (y[small] == 0).float().mean().item())
    assert errs["dt8_block256"][1] == 0.0 and errs["int8_block256"][1] > 0.1
    assert errs["dt8_block256"][0] < 0.1 and errs["int8_block256"][0] > 0.5, errs


def test_budget_counts_one_byte_code_and_an_fp32_scale_per_256():
    w = [
        (
            "w",
            (512, 256),
            "LowBitAdamW",
            {"lr": 1.0, "exp_avg": "dt8_block256", "exp_avg_sq": "udt8_block256"},
        )
    ]
    b = state_bytes(w).per_param()
    assert b["exp_avg"] == b["exp_avg_sq"] == 1 + 4 / 256


def test_bad_choices_give_one_line():
    with pytest.raises(ValueError) as e:
        adamw(params(), exp_avg="udt8_block256")
    msg = str(e.value)
    assert msg.startswith("exp_avg='udt8_block256': format 'udt8' is unsigned") and "\n" not in msg
    with pytest.raises(ValueError) as e:
        adamw(params(), exp_avg_sq="dt9_block256")
    msg = str(e.value)
    assert msg.startswith("exp_avg_sq='dt9_block256':") and "dt8" in msg and "\n" not in msg
    assert parse_state_format("udt8_block64").block_size == 64  # any block size by the name pattern


@pytest.mark.parametrize("name", ["dt8_block256", "udt8_block64", "dt8_block128_sr"])
def test_state_codec_equals_formats_quantize(name):
    # the optimizer's codec (its own code search) gives ``formats.quantize``'s codes and scales bit for bit
    spec = parse_state_format(name)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 512, generator=g) * torch.logspace(-6, 1, 8)[:, None]
    x = x.abs() if not spec.elem.signed else x
    key = torch.tensor(11)
    parts = StateCodec(spec).encode(x, key)
    q = quantize(x, spec, key)
    assert torch.equal(parts["_codes"].reshape(-1), q.codes)
    assert torch.equal(parts["_scales"].reshape(-1), q.scales.reshape(-1))
    assert torch.equal(StateCodec(spec).decode(parts, tuple(x.shape)), dequantize(q))
