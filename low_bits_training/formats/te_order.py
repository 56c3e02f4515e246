"""Transformer Engine's NVFP4 scale arithmetic, ``QuantSpec.scale_order = "te"`` (issue 38).

TE's NVFP4 quantizer (as its pure-PyTorch reference ``quantization_ref_nvfp4.py`` writes it) works from an
encode scale, every step in fp32 (fl: rounded to fp32; NVFP4's numbers, 2688 = 448 x 6):

- tensor: e = fl(2688 / amax), capped at fp32's max (a zero amax gives the cap); an e of 0 (infinite amax)
  becomes 1;
- block: round_e4m3(fl(amax_b x fl(e x fl(1 / 6)))), the product capped at fp32's max, then at 448;
- values: x times fl(1 / fl(block x fl(1 / e))), capped at fp32's max, then rounded to e2m1; its cast codes a
  product that is 0 (-0 included) as +0, a negative one that rounds to 0 as -0.

Ours (``"decode"``) divides decode scales down instead: fl(fl(amax_b / 6) / fl(amax / 2688)). The two differ
by an ulp before the e4m3 or e2m1 rounding, so only at ties: a block of amax 9/1024 under a tensor amax of 3
gets 1.25 from us and 1.375 from TE (``tests/formats/test_scale_order.py``). Not taken from TE: its zero
blocks' stored block scale 0 (ours 1; the values are 0 either way), and its dequantization, which rounds
fl(block x amax) x fl(1 / 2688) where ours rounds (element x block) x fl(amax / 2688). A tensor amax below
2688 / fp32 max (about 7.9e-36) saturates e, and TE's block scales then use a fraction of e4m3's range (its
quirk, kept: "te" equals TE there too).

torchao 0.18's NVFP4 training kernels (``scale_order = "torchao"``; Triton, CUDA only: its ``_nvfp4_quantize``
in ``moe_training/nvfp4_training/hadamard_utils.py`` and the 16 x 16 weight cast beside it) take the same
steps but one: the block scale is round_e4m3(fl(fl(amax_b / 6) x e)), clamped to [2^-6, 448] first (our
``scale_min = "normal"``); a zero tensor amax gives e = 1 (its blocks are 0 either way), and the signs
are kept (no +0 rule; what its PTX cast does with -0 is not seen on a CPU).

One level of exact scales under ``"te"`` (no tensor scale: fp8 blocks / tiles as TE's ``Float8BlockQuantizer``
computes them with fp32 scales, ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``): the values times e = fl(448 /
amax_b), the stored scale fl(1 / e); ours divides by fl(amax_b / 448), one ulp apart for about 27% of amaxes
(every mantissa of one binade, ``tests/formats/test_fp8_block_te.py``). Signs are kept. TE's power-of-two
scales, 2^floor(log2 fl(448 / amax_b)), are our ``scale_rounding = "rceil"`` for every amax (same test).
"""

from __future__ import annotations

import torch

from .rounding import div_rn

FP32_MAX = torch.finfo(torch.float32).max
"""The cap of TE's encode scales, raw block scales and multipliers."""


def encode_scale(tensor_amax: torch.Tensor, top: float) -> torch.Tensor:
    """e = fl(top / tensor amax) (top: 2688 for NVFP4), capped at fp32's max; 1 where it is 0."""
    # torch.div of two tensors: ``top / tensor`` would be top x fl(1 / amax), two roundings
    e = torch.div(torch.full_like(tensor_amax, top), tensor_amax).clamp_max(FP32_MAX)
    return torch.where(e == 0, 1.0, e)


def raw_block_scale(
    amax: torch.Tensor, encode: torch.Tensor, max_elem: float, order: str = "te"
) -> torch.Tensor:
    """The block scale before its rounding, capped at fp32's max: fl(amax x fl(e x fl(1 / max_elem))) (TE),
    or fl(fl(amax / max_elem) x e) (``order = "torchao"``: torchao's NVFP4 training kernels)."""
    if order == "torchao":
        return (div_rn(amax, max_elem) * encode).clamp_max(FP32_MAX)
    inv_max = torch.reciprocal(torch.full_like(encode, max_elem))
    return (amax * (encode * inv_max)).clamp_max(FP32_MAX)


def one_level(amax: torch.Tensor, max_elem: float) -> tuple[torch.Tensor, None, torch.Tensor]:
    """``(scale, None, inverse)`` of TE's one-level exact scales (its ``Float8BlockQuantizer`` with fp32
    scales): the values are multiplied by e = fl(max_elem / amax) (capped at fp32's max), dequantized by
    fl(1 / e); a zero group gets 1 and 1, a NaN amax NaN."""
    e = encode_scale(amax, max_elem)
    e = torch.where(amax == 0, 1.0, e)
    e = torch.where(torch.isnan(amax), float("nan"), e)
    return torch.reciprocal(e), None, e


def multiplier(block_scale: torch.Tensor, encode: torch.Tensor) -> torch.Tensor:
    """fl(1 / fl(block x fl(1 / e))), capped at fp32's max: what the values are multiplied by."""
    return torch.reciprocal(block_scale * torch.reciprocal(encode)).clamp_max(FP32_MAX)


def plus_zero(v: torch.Tensor) -> torch.Tensor:
    """``v`` with every 0 made +0 (TE's e2m1 cast reads -0 as +0)."""
    return torch.where(v == 0, 0.0, v)
