"""``formats.rounding.div_rn``: the block and tensor scales' division by a format's max, the same fp32 bits on
every device. CUDA divides by a Python number as a product with its reciprocal (eager and compiled); the GPU
check of 2026-11-28 (H200, torch 2.11) found deepseek_fp8's, NVFP4's and int8's casts differing from the CPU's
for that reason. Here the CUDA forms are computed on the CPU, from their definition."""

import pytest
import torch

from low_bits_training.formats.rounding import div_rn
from low_bits_training.formats.scaling import tensor_scale_max
from low_bits_training.formats.table import FORMATS, get_format
from low_bits_training.nn.recipes import recipe_specs


def _fp32_values(n: int, seed: int = 0) -> torch.Tensor:
    """n positive fp32 numbers with random bits: every binade, subnormals included, no inf / NaN."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(1, 0x7F800000, (n,), generator=g, dtype=torch.int32)
    return bits.view(torch.float32)


def _divisors() -> list[float]:
    """Every format's max (what ``scale_from_amax`` divides amax by) and each two-level recipe's tensor top
    (scale max x element max), as the scaling code forms them."""
    out = {get_format(name).max for name in FORMATS}
    for spec in (s for r in ("nvfp4", "nvfp4_4over6") for s in recipe_specs(r).values() if s is not None):
        out.add(tensor_scale_max(spec) * spec.elem.max)
    return sorted(c for c in out if c > 0)


def test_the_divisors_cover_the_scales_that_differed_on_the_gpu():
    divisors = _divisors()
    for c in (448.0, 127.0, 6.0, 2688.0):  # deepseek_fp8, int8, NVFP4's block and tensor scales
        assert c in divisors


@pytest.mark.parametrize("c", _divisors())
def test_the_true_quotient_and_both_cuda_forms_agree_bit_for_bit(c):
    a = _fp32_values(1 << 20, seed=int(c) % 1000)
    want = a / c  # the CPU's eager fp32 division: correctly rounded
    assert torch.equal(div_rn(a, c), want)
    # CUDA eager and inductor on a GPU: the float64 product with fl64(1 / c), then rounded to fp32
    assert torch.equal((a.double() * (1.0 / c)).float(), want)


def test_the_fp32_reciprocal_product_is_what_differed():
    # what CUDA computed for fp32 amax / 448 before div_rn: one ulp off for most values
    a = _fp32_values(1 << 20)
    off = (a * (1.0 / 448.0)) != a / 448.0
    assert off.float().mean().item() > 0.3
    ulps = ((a * (1.0 / 448.0)).view(torch.int32) - (a / 448.0).view(torch.int32)).abs()
    assert ulps.max().item() == 1


def test_compiled_on_the_cpu_equals_eager():
    a = _fp32_values(1 << 16, seed=3)
    fn = torch.compile(lambda t: div_rn(t, 448.0), fullgraph=True, backend="inductor")
    assert torch.equal(fn(a), a / 448.0)
