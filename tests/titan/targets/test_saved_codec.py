"""titan/targets/saved.py's fast save codec against nn.saved.ReferenceCodec (formats.quantize / dequantize)."""

from __future__ import annotations

import functools

import pytest
import torch

from low_bits_training.config.saved import SavedFormat
from low_bits_training.formats import QuantSpec
from low_bits_training.nn.saved import ReferenceCodec
from low_bits_training.titan.targets.saved import SaveCodec, codec_of

SPECS = [
    QuantSpec("e4m3", "tensor"),
    QuantSpec("e5m2", "axis"),
    QuantSpec("e4m3", "axis", scale_format="e8m0", scale_rounding="floor"),
    QuantSpec("e4m3", "axis", scale_format="bf16"),
    QuantSpec("int8", "axis"),
    QuantSpec("e4m3", "block", block_size=32, scale_format="e8m0", scale_rounding="rceil"),
    QuantSpec("e2m1", "block", block_size=16, scale_format="ue4m3"),
    QuantSpec("e4m3", "tensor", saturate=False),
    QuantSpec("e3m2", "none"),
]


def _values(dtype: torch.dtype) -> torch.Tensor:
    torch.manual_seed(0)
    x = torch.randn(6, 8, 64) * torch.logspace(-6, 3, 64)
    x[0, 0, :4] = torch.tensor([0.0, -0.0, 1e-30, -1e-30])
    x[1, 1, 5] = 1e6  # past e4m3's max: saturated, or its own NaN
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_decoded_saves_equal_the_reference_bit_for_bit(spec, dtype):
    x = _values(dtype)
    fast, ref = SaveCodec(spec), ReferenceCodec(spec)
    got, want = fast.decode(fast.encode(x)), ref.decode(ref.encode(x))
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num().view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       want.nan_to_num().view(torch.int16 if dtype == torch.bfloat16 else torch.int32))  # fmt: skip


def test_stored_bytes():
    x = _values(torch.float32)  # 3,072 elements in 48 rows of 64
    n = x.numel()
    assert (
        SaveCodec(QuantSpec("e4m3", "tensor")).nbytes(SaveCodec(QuantSpec("e4m3", "tensor")).encode(x))
        == n + 4
    )
    mx = QuantSpec("e2m1", "block", block_size=32, scale_format="e8m0", scale_rounding="floor")
    assert SaveCodec(mx).nbytes(SaveCodec(mx).encode(x)) == n // 2 + n // 32  # one-byte e8m0 scales
    rows = QuantSpec("e4m3", "axis", scale_format="e8m0", scale_rounding="floor")
    assert SaveCodec(rows).nbytes(SaveCodec(rows).encode(x)) == n + 48  # a one-byte scale per row
    bf16 = codec_of(SavedFormat(None, "bf16", 0, 0))
    assert bf16.nbytes(bf16.encode(x)) == 2 * n and bf16.fits(x) and not bf16.fits(x.bfloat16())
    assert codec_of(SavedFormat(None, None, 0, 0)) is None


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_a_save_holds_what_it_counts(spec):
    """What the allocator still holds after packing a save equals the bytes the codec counts (an e8m0-scaled
    save once held 4 more bytes per row: the fp32 scales, kept alive by a misplaced cache)."""
    from low_bits_training.optim.memory import HeldBytes

    x, codec, keep = _values(torch.bfloat16), SaveCodec(spec), []
    codec.encode(x)  # first-call work (format tables) out of the way
    meter = HeldBytes("cpu")
    with meter.recording():
        with meter.span("save"):
            keep.append(codec.encode(x))
    assert meter.held() == {"save": codec.nbytes(keep[0])}


def test_what_selective_checkpointing_keeps_is_packed_and_read_back_decoded():
    """A block under torchtitan's kind of SAC wrapper (torch's CheckpointWrapper, a policy that keeps every
    matmul output): ``pack_selective_saves`` routes the kept outputs through the save hooks, so the backward's
    recompute starts from their decoded values, and the bytes are counted. Without it SAC's cache holds them
    as made and the hooks see only the block's input."""
    import torch.nn.functional as F
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from low_bits_training.formats import fake_quantize
    from low_bits_training.nn import saved as nn_saved
    from low_bits_training.titan.targets.saved import pack_selective_saves

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3 = torch.nn.Linear(64, 128, bias=False), torch.nn.Linear(64, 128, bias=False)
            self.w2 = torch.nn.Linear(128, 64, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def keep_mm(ctx, op, *args, **kwargs):
        return (
            CheckpointPolicy.MUST_SAVE
            if op == torch.ops.aten.mm.default
            else CheckpointPolicy.PREFER_RECOMPUTE
        )

    spec = QuantSpec("e4m3", "tensor")
    torch.manual_seed(0)
    x = torch.randn(32, 64) * 3
    grads = {}
    for packed in (False, True):
        torch.manual_seed(1)
        inner = MLP()
        block = checkpoint_wrapper(inner, context_fn=lambda: create_selective_checkpoint_contexts(keep_mm))
        nn_saved.install(block, "block", nn_saved.SaveFormat(ReferenceCodec(spec), min_numel=0))
        if packed:
            assert pack_selective_saves(block) == 1
        else:  # torch's legacy behaviour, without its FutureWarning
            block.checkpoint_fn = functools.partial(block.checkpoint_fn, respect_saved_tensors_hooks=False)
        nn_saved.take_bytes()
        block(x).square().sum().backward()
        counts = nn_saved.take_bytes().get("block", (0, 0, 0))
        grads[packed] = [p.grad for p in inner.parameters()]
        # the block's input (the checkpoint keeps it through the hooks either way) and the three matmul outputs
        assert counts[0] == 32 * 64 + (32 * (2 * 128 + 64) if packed else 0)
    w1, w3, w2 = (p.detach() for p in inner.parameters())
    q = lambda t: fake_quantize(t, spec)  # noqa: E731
    a, b = q(x @ w1.T), q(x @ w3.T)  # the recompute starts from the decoded matmul outputs
    s = F.silu(a)
    g = 2 * ((F.silu(x @ w1.T) * (x @ w3.T)) @ w2.T)  # the forward itself ran on the values as made
    gm = g @ w2
    sig = torch.sigmoid(a)
    ga, gb = gm * b * (sig * (1 + a * (1 - sig))), gm * s
    qx = q(x)  # the recompute runs from the decoded input
    for got, want in zip(grads[True], [ga.T @ qx, gb.T @ qx, g.T @ (s * b)], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(grads[True], grads[False], strict=True))
