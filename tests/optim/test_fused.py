"""The fused (compiled) update equals the eager reference bit for bit for every state format; the codec's
compile-friendly pieces equal ``formats``'; a first step allocates no fp32 copy of a state.

Compiling on CPU takes seconds per kernel, so the configurations below each mix several formats and switches
(one compile each) and together cover: int8, e4m3, int4, e2m1 (e8m0 scales), bf16 and fp32 states, nearest
and stochastic state rounding, sqrt(v) storage, v_floor, and master weights in bf16 (nearest, Kahan) and e4m3
blocks (stochastic, and per-row scales when the block does not tile the row), for AdamW and SGD.
"""

from __future__ import annotations

import pytest
import torch

import low_bits_training.optim.base as optim_base
from low_bits_training.formats import decode, dequantize, encode, get_format, quantize
from low_bits_training.optim import LowBitAdamW, LowBitSGD, StateCodec, parse_state_format
from low_bits_training.optim.codec import grid_codes
from low_bits_training.optim.kernels import sqrt_rn
from low_bits_training.optim.memory import allocated_peak

CONFIGS = {
    "adamw int8/e4m3 sqrt v_floor, bf16 master kahan": (
        LowBitAdamW,
        dict(
            exp_avg="int8_block128",
            exp_avg_sq="e4m3_block128",
            master_weights="bf16",
            master_rounding="kahan",
        ),
    ),
    "adamw int4 sr/e2m1 e8m0, e4m3 master sr": (
        LowBitAdamW,
        dict(
            exp_avg="int4_block128_sr",
            exp_avg_sq="e2m1_block32_e8m0",
            master_weights="e4m3_block128",
            master_rounding="stochastic",
        ),
    ),
    "adamw fp32/bf16 sr, bf16 master": (
        LowBitAdamW,
        dict(exp_avg="fp32", exp_avg_sq="bf16_sr", master_weights="bf16", master_rounding="nearest"),
    ),
    "sgd bf16 nesterov decay, e4m3 master per row": (
        LowBitSGD,
        dict(momentum_buffer="bf16", nesterov=True, weight_decay=0.01, master_weights="e4m3_block128"),
    ),
}
# 200 columns: e4m3_block128 master weights fall back to one scale per row (the row is the chunk group).
SHAPES = {"sgd bf16 nesterov decay, e4m3 master per row": ((36, 200), (50, 200))}


def _opt(cls, ps, fused: bool, kw: dict, chunk_numel: int = 2048):
    base = {"lr": 1e-2, "min_quantized_numel": 0, "seed": 3, "fused": fused}
    if cls is LowBitAdamW:
        base |= {"betas": (0.9, 0.95), "weight_decay": 0.1}
    opt = cls([{"params": ps, "param_names": [f"w{i}" for i in range(len(ps))]}], **base, **kw)
    opt.chunk_numel = chunk_numel  # several chunks per parameter, the last one partial
    return opt


def _train(cls, kw: dict, shapes, fused: bool, steps: int = 3):
    g = torch.Generator().manual_seed(0)
    ps = [torch.randn(s, generator=g).requires_grad_() for s in shapes]
    opt = _opt(cls, ps, fused, kw)
    for k in range(steps):
        for p in ps:
            rows = torch.logspace(-3, 1, p.shape[0])[torch.randperm(p.shape[0], generator=g)]
            p.grad = torch.randn(p.shape, generator=g) * rows[:, None] * (1 + 10 * (k == 1))
        opt.step()
    return ps, opt


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fused_update_equals_eager_bit_for_bit(name):
    cls, kw = CONFIGS[name]
    shapes = SHAPES.get(name, ((48, 384), (40, 256)))
    eager_ps, eager = _train(cls, kw, shapes, fused=False)
    fused_ps, fused = _train(cls, kw, shapes, fused=True)
    for p, q in zip(eager_ps, fused_ps, strict=True):
        assert torch.equal(p, q)
        assert set(eager.state[p]) == set(fused.state[q])
        for k, v in eager.state[p].items():
            assert fused.state[q][k].dtype == v.dtype and torch.equal(fused.state[q][k], v), k
    assert len(eager.layout(eager_ps[0], eager.options(eager.param_groups[0])).chunks) > 2


def test_one_spec_on_other_dtypes_and_row_counts_keeps_eager_bits():
    """``optim.fused.kept_guards`` drops dynamo's guards on the frozen spec only: the same spec on fp32
    parameters, then bf16 ones (a new entry, found by the tensor guards), then one of a single row (dynamo
    specialises a size-1 dim) gives the eager reference's bits each time."""
    kw = dict(exp_avg="int8_block128", exp_avg_sq="int8_block128")
    for dtype, shape in ((torch.float32, (48, 384)), (torch.bfloat16, (48, 384)), (torch.float32, (1, 128))):
        ps = {}
        for fused in (False, True):
            g = torch.Generator().manual_seed(0)
            ps[fused] = torch.randn(shape, generator=g).to(dtype).requires_grad_()
            opt = _opt(LowBitAdamW, [ps[fused]], fused, kw)
            for _ in range(2):
                ps[fused].grad = (torch.randn(shape, generator=g) * 1e-2).to(dtype)
                opt.step()
        assert ps[True].dtype == dtype and torch.equal(ps[True], ps[False]), (dtype, shape)


def _codes_of_every_value(fmt: str) -> torch.Tensor:
    f = get_format(fmt)
    y = decode(torch.arange(2**f.bits, dtype=torch.uint8), f)  # every grid value, NaN / inf / -0 included
    return torch.cat([y, torch.tensor([float("nan"), -float("nan"), 0.0, -0.0])])


GRID_FORMATS = ("int8", "int4", "e4m3", "e5m2", "e2m1", "e3m2", "e2m3", "e3m4")


def test_grid_codes_equal_formats_encode_eager_and_compiled():
    values = {f: _codes_of_every_value(f) for f in GRID_FORMATS}
    want = {f: encode(y, f) for f, y in values.items()}
    compiled = torch.compile(
        lambda vs: [grid_codes(vs[f], get_format(f)) for f in GRID_FORMATS], fullgraph=True
    )
    for f, got in zip(GRID_FORMATS, compiled(values), strict=True):
        assert torch.equal(grid_codes(values[f], get_format(f)), want[f]), f
        assert torch.equal(got, want[f]), f


FAST_ROUTE_FORMATS = ("e4m3_block128", "e5m2_block128", "e2m1_block128", "e2m1_block32_e8m0", "e2m3_block32")
"""State formats whose nearest codes and decoding take ``optim.codec``'s vectorizing routes (the fp8 dtypes'
casts on CPU, threshold counting and integer decoding for small float formats)."""


def _values_with_specials() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 256, generator=g) * torch.logspace(-6, 3, 16)[:, None]
    x[0, :8] = torch.tensor(
        [float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-40, -1e-40]
    )
    x[1, :4] = torch.tensor([-0.0, 0.0, 1e-40, -1e-40])
    x[2] = 0.0
    x[2, 5] = -0.0
    # e2m1's midpoints (ties to the even code) in blocks whose amax maps to 6
    x[3] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0] * 32) * torch.tensor([1.0, -1.0]).repeat(
        128
    )
    return x


def test_fast_codec_routes_equal_formats_quantize_eager_and_compiled():
    x = _values_with_specials()
    codecs = [StateCodec(parse_state_format(n)) for n in FAST_ROUTE_FORMATS]
    encode_all = torch.compile(lambda x: [c.encode(x) for c in codecs], fullgraph=True)
    decode_all = torch.compile(
        lambda ps: [c.decode(p, (16, 256)) for c, p in zip(codecs, ps, strict=True)], fullgraph=True
    )
    compiled = encode_all(x)
    decoded = decode_all(compiled)
    for name, c, parts, values in zip(FAST_ROUTE_FORMATS, codecs, compiled, decoded, strict=True):
        q = quantize(x, c.spec)
        want = dequantize(q)
        for got in (c.encode(x), parts):
            assert torch.equal(got["_codes"].reshape(-1), q.codes), name
        for got in (c.decode(parts, (16, 256)), values):
            assert torch.equal(got.isnan(), want.isnan()), name
            assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(
                got[~got.isnan()].signbit(), want[~want.isnan()].signbit()
            ), name


def test_sqrt_rn_is_correctly_rounded_eager_and_compiled():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(1 << 16, generator=g) * 2.0 ** torch.randint(-140, 120, (1 << 16,), generator=g)
    x = torch.cat([x, torch.tensor([0.0, float("inf"), float("nan"), 1e-45, 3.4e38])])
    exact = torch.from_numpy(
        x.double().numpy() ** 0.5
    ).float()  # numpy's fp64 sqrt is IEEE, then one rounding
    for got in (sqrt_rn(x), torch.compile(sqrt_rn)(x)):
        assert torch.equal(got.isnan(), exact.isnan()) and torch.equal(got.nan_to_num(), exact.nan_to_num())


@pytest.mark.parametrize(
    "name",
    ["int8_block128", "e4m3_block128", "int4_block32_e8m0", "e2m1_block128", "int8_block64_bf16", "bf16"],
)
def test_zero_states_equal_encoded_zeros(name):
    c = StateCodec(parse_state_format(name))
    got, want = c.zeros((6, 256), torch.device("cpu")), c.encode(torch.zeros(6, 256))
    assert {k: (v.dtype, v.shape) for k, v in got.items()} == {k: (v.dtype, v.shape) for k, v in want.items()}
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("fused", [False, True])
def test_first_step_allocates_states_plus_one_calls_chunks(fused):
    # 1M elements: an fp32 copy of one state (4 MiB) would break the bound; chunks of 16K elements (64 KiB),
    # the fused update 4 of them a call (call_chunks).
    cls, kw = CONFIGS["adamw int8/e4m3 sqrt v_floor, bf16 master kahan"]
    p = torch.randn(1024, 1024).requires_grad_()
    p.grad = torch.randn(1024, 1024)
    opt = _opt(cls, [p], fused, kw, chunk_numel=1 << 14)
    peak = allocated_peak(opt.step)
    states = sum(v.nbytes for k, v in opt.state[p].items() if k != "step")
    assert states == 1024 * 1024 * (2 + 2 * 4 / 128 + 2)  # int8 m + e4m3 v + fp32 scales + bf16 Kahan
    assert states <= peak < states + (1 << 20), (peak - states) / 2**20


@pytest.mark.parametrize(
    ("exp_avg", "rows"), [("int8_block128", [64, 64, 16]), ("int8_block128_sr", [16] * 9)]
)
def test_a_call_runs_call_chunks_chunks_unless_they_draw_random_bits(monkeypatch, exp_avg, rows):
    """9 chunks of 16 rows (2048 elements in rows of 128): nearest states run 4 chunks a call (3 calls, the
    same bits, as the equality test above holds), stochastic ones a call per chunk (each its own key row)."""
    calls = []
    monkeypatch.setattr(
        optim_base, "run_fused", lambda spec, tensors, hyper, keys: calls.append(tensors[0].shape[0])
    )
    p = torch.randn(48, 384, requires_grad=True)
    p.grad = torch.randn_like(p)
    opt = _opt(LowBitAdamW, [p], True, {"exp_avg": exp_avg, "exp_avg_sq": "int8_block128"})
    assert opt.call_chunks == 4 and len(opt.layout(p, opt.options(opt.param_groups[0])).chunks) == 9
    opt.step()
    assert calls == rows
