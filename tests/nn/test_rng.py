"""Stochastic rounding in layers draws from its own per-step stream, not the global RNG."""

import torch

from low_bits_training.formats import QuantSpec
from low_bits_training.nn import rng
from low_bits_training.nn.cast import cast

SR = QuantSpec(
    "e4m3", "block", block_size=32, scale_format="e8m0", scale_rounding="floor", rounding="stochastic"
)


def test_step_stream_ignores_other_global_rng_draws():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    try:
        rng.set_step_seed(123)
        a = cast(x, SR)
        rng.set_step_seed(123)
        torch.rand(1000)  # e.g. a lazy first-step initialisation drawing from the global RNG
        b = cast(x, SR)
        rng.set_step_seed(124)
        c = cast(x, SR)
    finally:
        rng.set_step_seed(None)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)  # another step, other draws
    assert (a != x).any()


def test_without_a_step_seed_the_global_rng_is_used():
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(7)
    a = cast(x, SR)
    torch.manual_seed(7)
    b = cast(x, SR)
    assert torch.equal(a, b) and rng.generator_for(torch.device("cpu")) is None
