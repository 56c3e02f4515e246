"""Quantized dot-product attention (nn.attention) against torch's SDPA and the fp64 computation.

- A high-precision plan is SDPA: forward and the three input gradients agree to fp32 rounding (causal, a
  packed-document mask, grouped-query heads).
- Quantized plans stay within measured SQNR floors of the fp64 attention (forward and gradients), with a
  ceiling (floor + 8 dB) that catches a cast that silently stopped quantizing.
- The function compiles with fullgraph=True and gives eager's bits, stochastic rounding and probes included.

SQNR floors were measured with ``operands()`` (B=2, N=4 heads, L=S=128, H=64; fp32 inputs) and set ~1 dB
under the measurement: ``.venv/bin/python -m pytest tests/nn/test_attention.py -k sqnr -s`` prints them.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from nn_helpers import sqnr_db

from low_bits_training.formats import QuantSpec
from low_bits_training.nn import LinearPlan, ProbeMode, probe, rng
from low_bits_training.nn.attention import AttentionPlan, ProductState, quant_attention

E4M3, E5M2 = QuantSpec.fp8_tensorwise(), QuantSpec.fp8_tensorwise("e5m2")
MXFP8 = QuantSpec.mxfp8("e4m3", "rceil")


def _plan(inputs: QuantSpec | None, grads: QuantSpec | None) -> AttentionPlan:
    """The same spec on every Q/K/V/P operand, another on the gradients dS / dO, for both products."""
    roles = ("forward.input", "forward.weight", "dgrad.weight", "wgrad.input")
    specs = {**dict.fromkeys(roles, inputs), "dgrad.grad_output": grads, "wgrad.grad_output": grads}
    plan = LinearPlan.from_roles(specs)
    return AttentionPlan(qk=plan, pv=plan)


PLANS = {
    "fp8": _plan(E4M3, E5M2),  # Transformer Engine's fp8 DPA: e4m3 Q, K, V, P; e5m2 dS, dO; tensor scales
    "e4m3": _plan(E4M3, E4M3),
    "mxfp8": _plan(MXFP8, MXFP8),
}
# plan: (output, dq, dk, dv) SQNR floors in dB against the fp64 attention
FLOORS = {
    "fp8": (25.4, 19.9, 20.0, 22.5),  # e5m2 gradients: 2 mantissa bits
    "e4m3": (25.4, 23.0, 23.1, 25.3),
    "mxfp8": (25.5, 23.1, 23.2, 25.6),
}


def operands(b=2, n=4, nkv=4, seq=128, h=64, dtype=torch.float32, seed=0):
    """q (B, N, L, H), k, v (B, Nkv, S, H), dO: unit-scale activations, small gradients."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, seq, h, generator=g)
    k = torch.randn(b, nkv, seq, h, generator=g)
    v = torch.randn(b, nkv, seq, h, generator=g)
    do = torch.randn(b, n, seq, h, generator=g) * 1e-3
    return tuple(t.to(dtype) for t in (q, k, v, do))


def _grads(fn, q, k, v, do):
    ins = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o = fn(*ins)
    o.backward(do.to(o.dtype))
    return (o.detach(), *(t.grad for t in ins))


def _sdpa(mask=None, gqa=False):
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)

    return fn


def _ours(plan, mask=None, states=None):
    def fn(q, k, v):
        return quant_attention(q, k, v, plan, mask=mask, **({"states": states} if states else {}))

    return fn


def document_mask(seq: int, starts: tuple[int, ...]) -> torch.Tensor:
    """(1, 1, L, L) causal mask within packed documents that begin at ``starts``."""
    doc = torch.zeros(seq, dtype=torch.long)
    doc[list(starts)] = 1
    doc = doc.cumsum(0)
    return ((doc[:, None] == doc[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril())[None, None]


@pytest.mark.parametrize("case", ["causal", "documents", "gqa"])
def test_high_precision_plan_is_sdpa(case):
    q, k, v, do = operands(nkv=2 if case == "gqa" else 4)
    mask = document_mask(q.shape[2], (0, 40, 97)) if case == "documents" else None
    want = _grads(_sdpa(mask, gqa=case == "gqa"), q, k, v, do)
    got = _grads(_ours(AttentionPlan(), mask), q, k, v, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(g, w, msg=lambda m, n=name: f"{case} {n}: {m}")  # fp32 rounding


def test_rht_cancels_in_every_gemm():
    """An RHT along each GEMM's contraction dim (head_dim or seq_len) on both operands, fp32 elements: the
    rotation cancels, so the result is SDPA's to fp32 rounding."""
    rot = dataclasses.replace(QuantSpec("fp32", "none"), rht=16, rht_seed=3)
    plan = _plan(rot, rot)
    q, k, v, do = operands()
    want = _grads(_sdpa(), q, k, v, do)
    for name, g, w in zip(("out", "dq", "dk", "dv"), _grads(_ours(plan), q, k, v, do), want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_backward_casts_from_the_forward_cast():
    """``source = "forward"`` on dgrad.weight / wgrad.input (K, Q; V^T, P) reads the saved forward cast: with
    tensor scales that is the cast the backward would make itself, so the bits are the same."""
    fwd = {r: dataclasses.replace(E4M3, source="forward") for r in ("dgrad.weight", "wgrad.input")}
    others = ("forward.input", "forward.weight", "dgrad.grad_output", "wgrad.grad_output")
    kept = LinearPlan.from_roles({**dict.fromkeys(others, E4M3), **fwd})
    assert kept.saved_casts == ("forward.weight", "forward.input")
    q, k, v, do = operands()
    want = _grads(_ours(PLANS["e4m3"]), q, k, v, do)
    got = _grads(_ours(AttentionPlan(qk=kept, pv=kept)), q, k, v, do)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(PLANS))
def test_sqnr_against_fp64(name, dtype):
    q, k, v, do = operands(dtype=dtype)
    ref = _grads(_sdpa(), *(t.double() for t in (q, k, v, do)))
    got = _grads(_ours(PLANS[name]), q, k, v, do)
    measured = [sqnr_db(g, r) for g, r in zip(got, ref, strict=True)]
    print(f"\n{name} {dtype}: out / dq / dk / dv SQNR dB: {' / '.join(f'{s:.1f}' for s in measured)}")
    for what, s, floor in zip(("out", "dq", "dk", "dv"), measured, FLOORS[name], strict=True):
        assert floor <= s <= floor + 8, f"{name} {what}: SQNR {s:.1f} dB outside [{floor}, {floor + 8}]"


def _sr(spec: QuantSpec) -> QuantSpec:
    return dataclasses.replace(spec, rounding="stochastic")


class _Attention(torch.nn.Module):
    """quant_attention with its two ProductStates, as the model's attention module holds them."""

    def __init__(self, plan: AttentionPlan, name: str):
        super().__init__()
        self.plan = plan
        self.qk = ProductState(plan.qk, f"{name}.qk")
        self.pv = ProductState(plan.pv, f"{name}.pv")

    def forward(self, q, k, v):
        return quant_attention(q, k, v, self.plan, states=(self.qk.state, self.pv.state))


# qk: MXFP8 with stochastically rounded gradients; pv: delayed-scaled e4m3 (TE's DelayedScaling) and
# stochastically rounded e5m2 gradients.
MIXED = AttentionPlan(
    qk=_plan(MXFP8, _sr(MXFP8)).qk,
    pv=_plan(dataclasses.replace(E4M3, amax_history=8), _sr(E5M2)).pv,
)


def _step(module, fn, q, k, v, do):
    got = _grads(fn, q, k, v, do)
    return got, [s.clone() for s in (module.qk.lbt_stats, module.pv.lbt_stats, module.pv.lbt_amax_history)]


@pytest.mark.parametrize(
    "backend", ["aot_eager", "inductor"]
)  # aot_eager: the whole graph is captured (fullgraph) and traced through autograd, seconds instead of minutes
def test_compiled_fullgraph_equals_eager(backend):
    q, k, v, do = operands(b=1, n=2, nkv=1, seq=64, h=32)
    eager, comp = _Attention(MIXED, "layers.0.attention"), _Attention(MIXED, "layers.0.attention")
    compiled = torch.compile(comp, fullgraph=True, backend=backend)
    try:
        probe.set_mode(ProbeMode(stats=True, nonfinite=True))
        for step in (1, 2):
            rng.set_step_key(step)
            for m in (eager, comp):
                probe.reset(m.qk.state), probe.reset(m.pv.state)
            (got, got_state), (want, want_state) = (
                _step(comp, compiled, q, k, v, do),
                _step(eager, eager, q, k, v, do),
            )
            for name, g, w in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
                assert torch.equal(g, w), f"step {step}: {name}"
            for g, w in zip(got_state, want_state, strict=True):
                # dS comes from fp32 row sums that inductor may order otherwise: its statistics (not its
                # casts, which dq / dk show are equal) may differ in the last bits
                torch.testing.assert_close(g, w, rtol=1e-6, atol=0)
    finally:
        probe.set_mode(ProbeMode())
        rng.set_step_key(None)
    assert comp.pv.lbt_amax_history[0, 1] > 0  # forward.input (P): two casts recorded
    assert comp.qk.lbt_stats[0, 0] == q.numel()  # forward.input (Q) seen once per step
    assert not comp.qk.lbt_flags.any() and not comp.pv.lbt_flags.any()


def test_stochastic_rounding_keys():
    """The same step key rounds the same bits; another step, or another layer, others (nn.rng)."""
    q, k, v, do = operands(b=1, n=2, nkv=2, seq=64, h=32)
    a, b = _Attention(MIXED, "layers.0.attention"), _Attention(MIXED, "layers.1.attention")
    try:
        runs = []
        for module, step in ((a, 1), (a, 1), (a, 2), (b, 1)):
            rng.set_step_key(step)
            runs.append(_grads(module, q, k, v, do)[1])  # dq: from SR-rounded dS
    finally:
        rng.set_step_key(None)
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2]) and not torch.equal(runs[0], runs[3])


def test_block_size_that_does_not_fit_is_one_line():
    q, k, v, _ = operands(b=1, n=2, nkv=2, seq=64, h=48)
    with pytest.raises(ValueError, match=r"forward.input .*block_size=32 does not divide dim 3 of size 48"):
        quant_attention(q, k, v, PLANS["mxfp8"])
    q, k, v, _ = operands(b=1, n=2, nkv=3, seq=64, h=32)
    with pytest.raises(ValueError, match="3 kv heads do not divide 2 query heads"):
        quant_attention(q, k, v, AttentionPlan())
