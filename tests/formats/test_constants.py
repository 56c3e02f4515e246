"""Kept tensor constants (``formats.constants.kept``): one asked for first under the memory planner's fake mode
is not kept, so the eager calls after it see real values. The CI run of f56f8fe failed 35 tests this way: a
launcher check planned an NVFP4 run in the test process (cold plan cache), the RHT sign tensor it made was a
``FakeTensor`` and stayed; every later RHT cast raised ``DataDependentOutputException``."""

from __future__ import annotations

import pytest
import torch

from low_bits_training.formats import codebook, get_format
from low_bits_training.formats.hadamard import _SIGN_TENSORS, rht, rht_reference, sign_vector
from low_bits_training.optim import codec
from low_bits_training.titan.platform.compat import fake_tensor_mode

CACHES = (_SIGN_TENSORS, codebook._TABLES, codec._LUTS)


@pytest.fixture
def empty_caches():
    """The kept constants emptied for the test, then put back."""
    saved = [dict(c) for c in CACHES]
    for c in CACHES:
        c.clear()
    yield
    for c, s in zip(CACHES, saved, strict=True):
        c.clear()
        c.update(s)


def test_constants_made_under_a_fake_mode_are_not_kept(empty_caches):
    signs, book, cpu = sign_vector(16, 7), get_format("dt8"), torch.device("cpu")
    with fake_tensor_mode() as mode:
        x = mode.from_tensor(torch.randn(4, 32))
        made = (rht(x, signs), *codebook.tables(book, cpu), codec._lut("e4m3", cpu))
    assert all(type(t).__name__ == "FakeTensor" for t in made)  # the calls did run under the fake mode
    assert not any(CACHES)

    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(rht(x, signs).double(), rht_reference(x, signs), rtol=0, atol=1e-6)
    values, thresholds = codebook.tables(book, cpu)
    assert values.tolist() == list(book.values) and thresholds.tolist() == list(book.thresholds)
    lut = codec._lut("e4m3", cpu)
    assert lut[0x38].item() == 1.0 and lut[0x7E].item() == 448.0
    assert all(type(t) is torch.Tensor for c in CACHES for t in c.values())
    assert codec._lut("e4m3", cpu) is lut  # real ones are kept
