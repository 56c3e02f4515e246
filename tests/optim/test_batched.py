"""The fused step's batching of small chunks (``optim.fused.ChunkBatch``) changes no bit: parameters and every
state equal those of the same fused step run one chunk per compiled call (``batch_numel = 0``), on a mix of
small and large parameters (fp32 and bf16), under stochastic rounding of states and master weights (each chunk keeps its own random stream). Every batch
compiles (tens of seconds on a loaded CPU), so one configuration; tests/optim/test_fused.py holds the rest."""

from __future__ import annotations

import pytest
import torch

from low_bits_training.optim import LowBitAdamW
from low_bits_training.optim import fused as fused_mod

CONFIGS = {
    "adamw int8 sr/bf16 sr, bf16 master sr": (
        LowBitAdamW,
        dict(
            exp_avg="int8_block128_sr",
            exp_avg_sq="bf16_sr",
            master_weights="bf16",
            master_rounding="stochastic",
        ),
    ),
}
# A large parameter in several chunks (the last one partial, batched), small matrices and norms;
# min_quantized_numel 1024 leaves the norms in fp32 states: batches of 3 of either spec, the bf16 one alone.
SHAPES = [(64, 512), (256,), (16, 128), (3,), (24, 128), (40,), (8, 256)]
DTYPES = {6: torch.bfloat16}


def _run(cls, kw: dict, batch_numel: int, steps: int = 4):
    g = torch.Generator().manual_seed(0)
    ps = [
        torch.randn(s, generator=g).to(DTYPES.get(i, torch.float32)).requires_grad_()
        for i, s in enumerate(SHAPES)
    ]
    base = {"lr": 1e-2, "min_quantized_numel": 1024, "seed": 5, "batch_numel": batch_numel}
    if cls is LowBitAdamW:
        base |= {"betas": (0.9, 0.95), "weight_decay": 0.1}
    opt = cls([{"params": ps, "param_names": [f"p{i}" for i in range(len(ps))]}], **base, **kw)
    opt.chunk_numel = 6000
    for k in range(steps):
        for p in ps:
            p.grad = (torch.randn(p.shape, generator=g) * (1 + 10 * (k == 1))).to(p.dtype)
        opt.step()
    return ps, opt


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_step_equals_one_call_per_chunk_bit_for_bit(name, monkeypatch):
    cls, kw = CONFIGS[name]
    sizes = []
    real = fused_mod._run_batch
    monkeypatch.setattr(
        fused_mod, "_run_batch", lambda s, h, items: sizes.append(len(items)) or real(s, h, items)
    )
    batched_ps, batched = _run(cls, kw, batch_numel=4096)
    assert max(sizes) >= 3  # several chunks per compiled call really ran
    sizes.clear()
    plain_ps, plain = _run(cls, kw, batch_numel=0)
    assert not sizes
    for p, q in zip(plain_ps, batched_ps, strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q)
        assert set(plain.state[p]) == set(batched.state[q])
        for k, v in plain.state[p].items():
            w = batched.state[q][k]
            assert w.dtype == v.dtype and torch.equal(w, v), k
    assert len(plain.layout(plain_ps[0], plain.options(plain.param_groups[0])).chunks) > 2
    assert not torch.equal(plain_ps[0], torch.randn(SHAPES[0], generator=torch.Generator().manual_seed(0)))


def test_batched_step_follows_torch_adamw():
    # fp32 states, no master: the batched fused step is torch's AdamW to an ulp or two (as the unbatched one).
    g = torch.Generator().manual_seed(1)
    init = [torch.randn(s, generator=g) for s in SHAPES]
    ours = [t.clone().requires_grad_() for t in init]
    ref = [t.clone().requires_grad_() for t in init]
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
    opt = LowBitAdamW(ours, exp_avg="fp32", exp_avg_sq="fp32", **kw)
    torch_opt = torch.optim.AdamW(ref, foreach=False, **kw)
    for _ in range(3):
        for a, b in zip(ours, ref, strict=True):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        opt.step()
        torch_opt.step()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
