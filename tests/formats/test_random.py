"""Counter-based random bits: uniform, reproducible, the same eager and compiled, unbiased rounding."""

import pytest
import torch

from low_bits_training.formats import QuantSpec, derive_key, fake_quantize, fold_key, random_bits, uniform
from low_bits_training.formats.random import _words32, mix32, uniform_int


def test_mix32_is_a_bijection_on_16_bit_inputs_and_matches_lowbias32_reference():
    x = torch.arange(1 << 16, dtype=torch.int64)
    assert torch.unique(mix32(x)).numel() == 1 << 16

    def ref(v: int) -> int:  # the published lowbias32, in Python's exact integers
        v ^= v >> 16
        v = (v * 0x7FEB352D) & 0xFFFFFFFF
        v ^= v >> 15
        v = (v * 0x846CA68B) & 0xFFFFFFFF
        return v ^ (v >> 16)

    for v in (0, 1, 12345, 0xFFFFFFFF, 0x80000000, 0xDEADBEEF):
        assert int(mix32(torch.tensor(v, dtype=torch.int64))) == ref(v)


def test_bits_are_uniform_and_keyed():
    k = torch.tensor(derive_key("seed", 3, "layers.0.wq"), dtype=torch.int64)
    b = random_bits((512, 512), k)
    assert int(b.min()) >= 0 and int(b.max()) < 2**32
    assert abs(float(b.double().mean()) / 2**32 - 0.5) < 2e-3
    u = uniform((512, 512), k)
    assert abs(float(u.var()) - 1 / 12) < 1e-3 and float(u.max()) < 1.0
    assert torch.equal(random_bits((512, 512), k), b)  # a pure function of (key, index)
    assert not torch.equal(random_bits((512, 512), fold_key(k, 1)), b)
    # An element's word depends on its flat index only: a prefix of a larger draw is the same.
    assert torch.equal(random_bits((4, 512), k), b[:4])


def test_derive_key_is_stable_across_processes():
    # blake2b of the joined strings: a fixed value (a changed scheme would silently change every SR run).
    assert derive_key(0, 1) == derive_key("0", "1")
    assert derive_key(0, 1) == 5883142680259666304


def test_compiled_bits_and_stochastic_rounding_equal_eager():
    k = torch.tensor(987654321, dtype=torch.int64)
    x = torch.randn(128, 64)
    spec = QuantSpec.nvfp4(rounding="stochastic")
    f = torch.compile(lambda x, k: fake_quantize(x, spec, k), fullgraph=True)
    assert torch.equal(f(x, k), fake_quantize(x, spec, k))
    k.fill_(5)  # the key is read at run time, not baked into the graph
    assert torch.equal(f(x, k), fake_quantize(x, spec, k))


def test_counter_based_stochastic_rounding_is_unbiased():
    spec = QuantSpec("e2m1", "none", rounding="stochastic")
    x = torch.full((4, 256), 0.3)  # between the e2m1 neighbours 0 and 0.5: P(up) = 0.6
    n = 400
    mean = sum(float(fake_quantize(x, spec, torch.tensor(i)).mean()) for i in range(n)) / n
    sigma = (0.5 * 0.5 * 0.6 * 0.4 / (n * x.numel())) ** 0.5
    assert abs(mean - 0.3) < 3 * sigma


@pytest.mark.parametrize("key", [0, 987654321, 2**62 - 1, derive_key("seed", 7, "layers.1.w2")])
def test_int32_words_equal_the_int64_reference_eager_and_compiled(key):
    # uniform / uniform_int draw from _words32 (int32 two's complement: wrapping multiplies); it must give
    # random_bits' words exactly, eagerly and under inductor (whose C++ multiplies in unsigned arithmetic).
    k = torch.tensor(key, dtype=torch.int64)
    ref = random_bits((33, 1000), k)
    compiled = torch.compile(lambda k: _words32((33, 1000), k, None), fullgraph=True)
    for words in (_words32((33, 1000), k, None), compiled(k)):
        assert words.dtype == torch.int32
        assert torch.equal(words.to(torch.int64) & 0xFFFFFFFF, ref)
    assert torch.equal(uniform((33, 1000), k), (ref >> 8).to(torch.float32) * 2.0**-24)
    assert torch.equal(uniform_int((33, 1000), 22, k), (ref >> 10).to(torch.int32))
