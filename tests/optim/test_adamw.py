"""LowBitAdamW / LowBitSGD against torch's fp32 optimizers: exact with fp32 states, bounded error otherwise."""

from __future__ import annotations

import pytest
import torch
from optim_helpers import adamw, grads, moments, params, rel, run

from low_bits_training.optim import LowBitSGD, moment_bound

STEPS = 20


# With fp32 states our update is torch's up to the last bit of some ops: every op is rounded once (torch's eager
# lerp / addcmul / add(alpha) fuse a multiply-add on CPU, and its CPU sqrt is not correctly rounded; neither can
# be reproduced by a compiled kernel, and the compiled kernel must equal ours bit for bit). After 20 steps the
# weights (|w| ~ 1) differ by at most 2 ulps of 1 (measured 2.4e-7, on ~10% of the elements).
ULPS_OF_ONE = 4 * torch.finfo(torch.float32).eps


def test_fp32_states_equal_torch_adamw_to_an_ulp():
    ref, ps = params(), params()
    o_ref = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    run(o_ref, ref, range(STEPS))
    run(adamw(ps, exp_avg="fp32", exp_avg_sq="fp32"), ps, range(STEPS))
    for a, b in zip(ps, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=ULPS_OF_ONE)
        assert (a == b).float().mean() > 0.8  # most elements agree to the bit


@pytest.mark.parametrize("nesterov", [False, True])
def test_fp32_buffer_equals_torch_sgd_to_an_ulp(nesterov):
    ref, ps = params(), params()
    kw = {"lr": 1e-2, "momentum": 0.9, "nesterov": nesterov, "weight_decay": 0.01}
    run(torch.optim.SGD(ref, foreach=False, **kw), ref, range(STEPS))
    run(LowBitSGD(ps, momentum_buffer="fp32", fused=False, **kw), ps, range(STEPS))
    for a, b in zip(ps, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=ULPS_OF_ONE)
        assert (a == b).float().mean() > 0.8


# (m format, v format) -> bounds on the relative Frobenius error of m, v after 20 steps and of the total
# weight change, against fp32 AdamW fed the same gradients. Measured (2026-11): see docs/optimizers.md.
BOUNDS = {
    ("bf16", "bf16"): (0.006, 0.006, 0.004),  # measured 0.0037, 0.0037, 0.0023
    ("int8_block128", "e4m3_block128"): (0.02, 0.1, 0.045),  # 0.012, 0.070, 0.030
    ("int8_block128", "int8_block128"): (0.02, 0.02, 0.036),  # 0.012, 0.012, 0.024
    ("e4m3_block128", "e4m3_block128"): (0.065, 0.1, 0.05),  # 0.044, 0.070, 0.032
    ("int8_block128_sr", "e4m3_block128_sr"): (0.03, 0.15, 0.065),  # 0.018, 0.100, 0.043
    ("int4_block128", "e2m1_block128"): (0.28, 0.36, 0.4),  # 0.185, 0.241, 0.267
    ("e2m1_block128", "int4_block128"): (0.27, 0.28, 0.45),  # 0.175, 0.186, 0.303: the 4-bit presets'
}


@pytest.mark.parametrize(("fm", "fv"), list(BOUNDS))
def test_state_error_against_fp32_adamw_is_bounded(fm, fv):
    ref, ps = params(), params()
    o_ref = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    o = adamw(ps, exp_avg=fm, exp_avg_sq=fv, min_quantized_numel=0)
    run(o_ref, ref, range(STEPS))
    run(o, ps, range(STEPS))
    w0 = params()
    bm, bv, bw = BOUNDS[(fm, fv)]
    for p, r, p0 in list(zip(ps, ref, w0, strict=True))[:2]:  # the matrices: quantized states
        m, v = moments(o, p)
        assert rel(m, o_ref.state[r]["exp_avg"]) < bm
        assert rel(v, o_ref.state[r]["exp_avg_sq"]) < bv
        assert rel(p.detach() - p0, r.detach() - p0) < bw
        assert rel(m, o_ref.state[r]["exp_avg"]) > 0 or fm == "fp32"  # the states really are quantized


def test_small_and_1d_params_keep_fp32_states():
    ps = params()
    o = adamw(ps)
    run(o, ps, range(1))
    assert o.state[ps[0]]["exp_avg_codes"].dtype == torch.uint8
    assert o.state[ps[2]]["exp_avg"].dtype == torch.float32  # 1-D
    assert o.state[ps[1]]["exp_avg"].dtype == torch.float32  # 3072 elements: below min_quantized_numel


@pytest.mark.parametrize("fused", [False, True])
def test_a_scalar_parameter_steps_as_torch_adamw(fused):
    # A 0-d parameter (a learned temperature or gate) once raised IndexError in the codec's shapes: it keeps fp32
    # states, so its update is torch's to an ulp.
    ref, p = (torch.tensor(1.5, requires_grad=True) for _ in range(2))
    o_ref = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    o = adamw([p], fused=fused)
    for k in range(5):
        ref.grad, p.grad = (torch.tensor(0.5 - 0.3 * k) for _ in range(2))
        o_ref.step(), o.step()
    assert o.state[p]["exp_avg"].shape == () and o.state[p]["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(p, ref, rtol=0, atol=ULPS_OF_ONE)
    assert abs(p.item() - 1.5) > 0.02  # it moved


def test_moment_bound_holds_for_exact_adam():
    b1, b2 = 0.9, 0.95
    c = moment_bound(b1, b2)
    m = v = torch.zeros(1000, dtype=torch.float64)
    for k in range(50):
        g = grads(k)[0].reshape(-1)[:1000].double() * (1 + 100 * (k % 7 == 0))
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        assert (m.abs() <= c * v.sqrt() * (1 + 1e-9)).all()
    assert moment_bound(0.99, 0.95) is None


def test_v_floor_prevents_blowup_when_v_underflows():
    # One huge outlier per block makes e2m1's block scale large: small sqrt(v) entries round to 0.
    torch.manual_seed(0)
    outs = {}
    for floor in (False, True):
        p = torch.zeros(4, 128, requires_grad=True)
        o = adamw(
            [p],
            lr=1e-3,
            exp_avg="bf16",
            exp_avg_sq="e2m1_block128",
            v_floor=floor,
            min_quantized_numel=0,
            weight_decay=0.0,
            eps=1e-12,
        )
        for k in range(10):
            g = torch.full((4, 128), 1e-3) if k < 5 else torch.full((4, 128), 1e-9)
            g[:, 0] = 10.0 if k < 5 else 1e-9
            p.grad = g
            o.step()
        outs[floor] = p.detach().abs().max().item()
    assert outs[True] < 0.02 < outs[False]  # exact Adam moves each weight by ~lr per step


def test_chunks_give_the_same_states_and_weights():
    # Nearest rounding: chunking changes nothing (it only keys the random streams of stochastic rounding).
    big, small = params(), params()
    kw = {"exp_avg": "int8_block128", "exp_avg_sq": "e2m1_block32_e8m0", "master_weights": "e4m3_block128"}
    o_big, o_small = adamw(big, **kw), adamw(small, **kw)
    o_small.chunk_numel = 1000  # 7 rows of 128 (the group: lcm of the blocks) per chunk: uneven last chunk
    run(o_big, big, range(3))
    run(o_small, small, range(3))
    opts = o_big.options(o_big.param_groups[0])
    assert len(o_small.layout(small[0], opts).chunks) == 19 and len(o_big.layout(big[0], opts).chunks) == 1
    for a, b in zip(big, small, strict=True):
        assert torch.equal(a, b)
        for k, v in o_big.state[a].items():
            assert torch.equal(o_small.state[b][k], v), k


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_a_closure_is_called_with_gradients_on_and_its_loss_returned_as_torch_does(name):
    # torch.optim.Optimizer.step(closure): the closure runs under enable_grad (step itself is no_grad), may
    # recompute the gradients, and step returns its loss. Ours: the same loss and weights as torch's own.
    x = torch.randn(32, 256, generator=torch.Generator().manual_seed(3))

    def stepped(make, ps):
        opt = make(ps)

        def closure():
            opt.zero_grad()
            loss = sum(((x @ p.T) ** 2).mean() if p.dim() == 2 else (p**2).sum() for p in ps[:1] + ps[2:])
            loss.backward()
            return loss

        return [opt.step(closure).item() for _ in range(3)]

    if name == "adamw":
        ref, ps = params(), params()
        ours = stepped(lambda q: adamw(q, exp_avg="fp32", exp_avg_sq="fp32"), ps)
        theirs = stepped(
            lambda q: torch.optim.AdamW(q, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, foreach=False), ref
        )
    else:
        ref, ps = params(), params()
        kw = {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.01}
        ours = stepped(lambda q: LowBitSGD(q, momentum_buffer="fp32", fused=False, **kw), ps)
        theirs = stepped(lambda q: torch.optim.SGD(q, foreach=False, **kw), ref)
    assert ours == pytest.approx(theirs, rel=1e-6) and ours[0] > ours[-1]
    for a, b in zip(ps, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=ULPS_OF_ONE)
