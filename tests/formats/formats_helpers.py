"""Shared helpers for tests/formats: bit-exact comparison and probe values covering a format's range."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

from low_bits_training.formats import get_format
from low_bits_training.formats.reference import ref_grid


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """Equal bit patterns, except that any NaN matches any NaN (payloads and NaN signs are not compared)."""
    a, e = actual.float(), expected.float()
    assert a.shape == e.shape, (a.shape, e.shape)
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    bad = (nan_a != nan_e) | (~nan_a & ~nan_e & (a.view(torch.int32) != e.view(torch.int32)))
    if bad.any():
        idx = bad.nonzero()[:8].flatten().tolist()
        rows = [(float(a.flatten()[i]), float(e.flatten()[i])) for i in idx]
        raise AssertionError(f"{what}: {int(bad.sum())} of {a.numel()} differ, first (got, expected): {rows}")


def finite_grid(name: str) -> torch.Tensor:
    """Sorted distinct finite values of a format (<= 16 bits), fp32."""
    vals = sorted({v for v in ref_grid(name) if math.isfinite(v)})
    return torch.tensor(vals, dtype=torch.float32)


def midpoints(grid: torch.Tensor) -> torch.Tensor:
    """Exact midpoints of neighbouring grid values (ties) and the fp32 values one ulp either side."""
    g = grid.double()
    mid = ((g[1:] + g[:-1]) / 2).float()
    assert torch.equal(mid.double(), (g[1:] + g[:-1]) / 2), "midpoint not exact in fp32"
    return torch.cat([mid, torch.nextafter(mid, mid - 1), torch.nextafter(mid, mid + 1)])


def probe_values(name: str, n_random: int = 20000, seed: int = 0) -> torch.Tensor:
    """Values that exercise every rounding decision of a format: all grid values, ties and their fp32
    neighbours, log-uniform randoms from far below the smallest subnormal to far above max, random fp32
    bit patterns (NaN, inf, fp32 subnormals), the specials; both signs."""
    fmt = get_format(name)
    gen = torch.Generator().manual_seed(seed)
    grid = finite_grid(name)
    pos = grid[grid > 0]
    lo, hi = math.log2(fmt.min_subnormal) - 4, math.log2(fmt.max) + 4
    logu = torch.exp2(lo + (hi - lo) * torch.rand(n_random, generator=gen, dtype=torch.float64)).float()
    bits = torch.randint(-(2**31), 2**31 - 1, (n_random // 4,), generator=gen, dtype=torch.int32)
    beyond = torch.tensor([fmt.max * 1.0625, fmt.max * 1.5, fmt.max * 2, 1e30, 3e38])
    specials = torch.tensor([0.0, float("inf"), float("nan"), 2.0**-149, 2.0**-126, 2.0**-127])
    pos_all = torch.cat([pos, midpoints(pos), torch.nextafter(pos, pos + 1), logu, beyond, specials])
    return torch.cat([pos_all, -pos_all, bits.view(torch.float32)])


ML_DTYPES = {
    "e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
    "e3m2": "float6_e3m2fn",
    "e2m3": "float6_e2m3fn",
    "e2m1": "float4_e2m1fn",
    "e8m0": "float8_e8m0fnu",
    "e3m4": "float8_e3m4",
    "bf16": "bfloat16",
}


def ml_cast(x: torch.Tensor, name: str) -> torch.Tensor:
    """Round-trip through ml_dtypes (x as fp32 numpy -> format -> fp32)."""
    dt = getattr(ml_dtypes, ML_DTYPES[name])
    with np.errstate(invalid="ignore", over="ignore"):
        arr = x.float().numpy().astype(dt).astype(np.float32)
    return torch.from_numpy(arr)


def ml_codes(name: str) -> torch.Tensor:
    """ml_dtypes' value for every code of an <= 8-bit format, fp32 (codes in the low bits)."""

    fmt = get_format(name)
    codes = np.arange(fmt.n_codes, dtype=np.uint8)
    return torch.from_numpy(codes.view(getattr(ml_dtypes, ML_DTYPES[name])).astype(np.float32))


F32 = np.float32


def te_scaled(x: np.ndarray, tile: int = 1) -> tuple[np.ndarray, np.ndarray, np.float32]:
    """The first half of ``te_reference``: ``(values in scale units, e4m3 block scales, tensor scale)``, the
    values (before the e2m1 cast) of shape (m / tile, tile, n / 16, 16), the block scales broadcast to it."""
    m, n = x.shape
    xb = x.astype(F32).reshape(m // tile, tile, n // 16, 16)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        amax = np.abs(x).max().astype(F32)
        enc = np.minimum(F32(2688) / amax, np.finfo(F32).max).astype(F32)
        enc = F32(1) if enc == 0 else enc
        dec = F32(F32(1) / enc)
        vmax = np.abs(xb).max(axis=(1, 3), keepdims=True).astype(F32)
        block = np.minimum(vmax * F32(enc * F32(F32(1) / F32(6))), np.finfo(F32).max).astype(F32)
        block = np.clip(block, -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(F32)
        mult = np.minimum(F32(1) / (block * dec).astype(F32), np.finfo(F32).max).astype(F32)
        v = np.clip((xb * mult).astype(F32), -6, 6)
    return v, block, F32(amax / F32(2688)) if amax else F32(1)


def te_reference(x: np.ndarray, tile: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Transformer Engine's NVFP4 quantization (its published pure-PyTorch reference), written from its
    algorithm in numpy fp32: ``(e2m1 values, e4m3 block scales, dequantized values)`` of a 2-D x, blocks of
    ``tile`` x 16 (1: rows, 16: TE's 2-D weight tiles). Dequantized: value x block scale x fl(amax / 2688)."""
    v, block, ts = te_scaled(x, tile)
    with np.errstate(invalid="ignore", over="ignore"):
        q = v.astype(ml_dtypes.float4_e2m1fn).astype(F32)
        q = np.where(v == 0, F32(0), q)  # a 0 after the multiply is +0
        deq = ((q * block).astype(F32) * ts).astype(F32)
    return q.reshape(x.shape), block, deq.reshape(x.shape)
