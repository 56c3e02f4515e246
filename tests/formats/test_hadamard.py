"""The random Hadamard transform: butterfly == dense float64 definition, orthogonal (a GEMM's RHT cancels),
torchao's NVFP4 transform for its sign vector, seeded signs, eager == compiled bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from low_bits_training.formats import hadamard
from low_bits_training.formats.hadamard import hadamard_matrix, rht, rht_reference, sign_vector

TORCHAO_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
"""torchtitan's fixed NVFP4 sign vector (components/quantization/nvfp4.py ``_HARDCODED_SIGN_VECTOR``)."""


def _x(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * (1 + 30 * (torch.rand(shape[-1], generator=g) > 0.95))
    return x.to(dtype)


def test_sign_vector_is_a_seeded_pure_function():
    a = sign_vector(16, 0)
    assert len(a) == 16 and set(a) <= {-1, 1} and a == sign_vector(16, 0)
    assert a != sign_vector(16, 1) and sign_vector(32, 0)[:16] != a  # sizes and seeds draw other signs
    assert 4 <= sum(v > 0 for v in sign_vector(64, 3)) <= 60


def test_hadamard_matrix_is_sylvester():
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    h = h2
    for size in (4, 8, 16, 32):
        h = torch.kron(h2, h)  # Sylvester: H_2n = [[H, H], [H, -H]]
        assert torch.equal(hadamard_matrix(size), h)
        assert torch.equal(h @ h.T, size * torch.eye(size, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("axis", [0, -1])
@pytest.mark.parametrize("size", [2, 4, 8, 16, 32, 64, 128])  # 128: the staged form (> COLUMNS_UP_TO)
def test_butterfly_equals_the_dense_definition(size, axis, dtype):
    x = _x((128, max(64, size)), size, dtype)
    got, ref = rht(x, sign_vector(size, 7), axis), rht_reference(x, sign_vector(size, 7), axis)
    assert got.dtype == torch.float32 and got.shape == x.shape
    # log2(n) fp32 add stages, magnitudes growing at most 2x per stage: |error| <= 2**-23 sqrt(n) max|x|.
    bound = 2.0**-22 * math.sqrt(size) * x.abs().max().item()
    assert (got.double() - ref).abs().max().item() <= bound


@pytest.mark.parametrize("size", [4, 16, 64])
def test_transform_cancels_in_a_gemm(size):
    a, b = _x((48, 128), 1), _x((128, 40), 2)
    s = sign_vector(size, 5)
    ref = a.double() @ b.double()
    exact = rht_reference(a, s, -1) @ rht_reference(b, s, 0)
    assert torch.allclose(exact, ref, rtol=0, atol=1e-10 * ref.abs().max().item())
    fast = rht(a, s, -1) @ rht(b, s, 0)
    assert (fast.double() - ref).abs().max().item() < 1e-5 * ref.abs().max().item()


def test_equals_torchaos_nvfp4_transform():
    from torchao.prototype.moe_training.nvfp4_training.hadamard_utils import get_rht_matrix

    x = _x((64, 256), 3)
    m = get_rht_matrix(TORCHAO_SIGNS, "cpu", torch.float64, 16)
    ref = (x.double().reshape(-1, 16) @ m).reshape(x.shape)
    assert torch.allclose(rht_reference(x, TORCHAO_SIGNS), ref, rtol=0, atol=1e-12)
    assert (rht(x, TORCHAO_SIGNS).double() - ref).abs().max().item() < 2.0**-20 * x.abs().max().item()


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_column_and_staged_butterflies_give_the_same_bits(monkeypatch, axis):
    x = _x((64, 32, 48), 3)
    s = sign_vector(16, 5)
    columns = rht(x, s, axis)
    monkeypatch.setattr(hadamard, "COLUMNS_UP_TO", 0)
    assert torch.equal(columns.view(torch.int32), rht(x, s, axis).view(torch.int32))


def test_compiled_equals_eager_bit_for_bit():
    x = _x((64, 96), 4)
    s = sign_vector(16, 2)
    fn = torch.compile(lambda t: (rht(t, s, 0), rht(t, s, -1)), backend="inductor", fullgraph=True)
    for eager, compiled in zip((rht(x, s, 0), rht(x, s, -1)), fn(x), strict=True):
        assert torch.equal(eager.view(torch.int32), compiled.view(torch.int32))


def test_size_errors():
    with pytest.raises(ValueError, match="RHT size 12 must be a power of two"):
        sign_vector(12)
    with pytest.raises(ValueError, match="RHT size 16 does not divide dim 0 of size 24"):
        rht(torch.zeros(24, 16), sign_vector(16), 0)


def test_te_signs_are_transformer_engines_vector_and_differ_from_our_seeded_one():
    # issue 38: TE's NVFP4 wgrad RHT uses a fixed vector; ours (seed 0) differs in 7 of 16 signs and 112 of the
    # 256 matrix entries. With TE's vector our matrix is torchao's get_rht_matrix of that vector, entry for entry.
    from torchao.prototype.moe_training.nvfp4_training.hadamard_utils import get_rht_matrix

    te = sign_vector(16, 0, "te")
    assert te == (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)
    seeded = sign_vector(16, 0)
    assert seeded == (1, -1, -1, 1, 1, -1, -1, 1, -1, 1, 1, 1, -1, 1, -1, 1)
    assert sum(a != b for a, b in zip(te, seeded, strict=True)) == 7
    eye = torch.eye(16, dtype=torch.float64)
    ours_te, ours_seeded = (
        rht_reference(eye, te),
        rht_reference(eye, seeded),
    )  # rows: the matrix diag(s) H / 4
    assert torch.equal(ours_te, get_rht_matrix(te, "cpu", torch.float64, 16))
    assert int((ours_te != ours_seeded).sum()) == 112


def test_named_signs_need_their_length_and_reach_the_gemm_through_the_spec():
    from low_bits_training.formats import QuantSpec

    with pytest.raises(ValueError, match="rht_signs='te' is a 16-long vector; it needs rht = 16, got 32"):
        QuantSpec.nvfp4(rht=32, rht_signs="te")
    with pytest.raises(ValueError, match="RHT signs 'te' are 16 long; the RHT size is 32"):
        sign_vector(32, 0, "te")
    spec = QuantSpec.nvfp4(rht=16, rht_signs="te", rht_seed=9)  # a named vector ignores the seed
    assert hadamard.operand_signs(spec) == hadamard.NAMED_SIGNS["te"]
    assert spec.short().startswith("rht16te:")
    assert QuantSpec.nvfp4(rht=16, rht_seed=9).short().startswith("rht16s9:")


def test_the_named_signs_are_the_choices_of_the_spec_field():
    from typing import get_args

    from low_bits_training.formats.spec import RhtSigns

    assert get_args(RhtSigns) == ("seeded", *hadamard.NAMED_SIGNS)
