"""The random Hadamard transform (RHT): a seeded, orthogonal mixing of each block of ``size`` values.

For a block v of length n (a power of two) the transform is ``T(v) = H (s * v) / sqrt(n)``: s is a random
+-1 sign vector, H the Sylvester Hadamard matrix ``H[i][j] = (-1)**popcount(i & j)``. T is orthogonal, so
applied to both operands of a GEMM along the contraction dim it cancels in the product:
``sum_k T(a)_k T(b)_k = sum_k a_k b_k``. It spreads an outlier over its block, which is what the NVFP4
training recipe (arXiv 2509.25149, sec. 4.2) uses it for on the weight-gradient GEMM's operands; torchao's
``NVFP4Linear`` computes ``x_block @ (diag(s) H / 4)``: the same T for n = 16.

The transform is block-diagonal: every block of ``size`` values along the dim uses the same n-long sign
vector, so a shard of the dim (tensor parallelism) transforms alone, and every rank derives the vector from
(seed, size) with ``derive_key`` (``sign_vector``), never from a generator.

Fast path: the in-place-free butterfly (log2(n) stages of ``(a + b, a - b)``) along the dim, blocks kept in
place, elementwise fp32 adds only, so eager and torch.compile give the same bits. ``rht_reference`` builds
the dense matrix and multiplies in float64: the slow definition the butterfly is held to
(tests/formats/test_hadamard.py).
"""

from __future__ import annotations

import functools
import math

import torch

from low_bits_training.upstream import unset_fake_temporarily

from .constants import kept
from .random import derive_key, random_bits
from .rounding import round_to


def check_size(size: int) -> None:
    """Raises ValueError unless ``size`` is a power of two >= 2."""
    if not isinstance(size, int) or size < 2 or size & (size - 1):
        raise ValueError(f"RHT size {size!r} must be a power of two >= 2")


NAMED_SIGNS: dict[str, tuple[int, ...]] = {
    "te": (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1),
}
"""Fixed sign vectors by name (``QuantSpec.rht_signs``): "te" is the one Transformer Engine's NVFP4 recipe
applies to its 16-point wgrad RHT (its value as read from TE's source, issue 38). With it, our RHT matrix
equals TE's and torchao's ``get_rht_matrix`` given the same vector (tests/formats/test_hadamard.py)."""


@torch.compiler.assume_constant_result  # a traced graph takes the tuple as a constant (hashlib is not traceable)
def sign_vector(size: int, seed: int = 0, signs: str = "seeded") -> tuple[int, ...]:
    """The RHT's signs: ``size`` values +-1, a pure function of (size, seed) (every rank, every run), or a
    fixed vector by name.

    Args:
        size: the block size (a power of two).
        seed: any int ("seeded" only).
        signs: "seeded" (drawn from (size, seed)) or a key of ``NAMED_SIGNS`` (its length must be ``size``).

    Returns:
        A tuple of +1 / -1 ints.
    """
    if signs == "seeded":
        return _sign_vector(size, seed)
    named = NAMED_SIGNS[signs]
    if len(named) != size:
        raise ValueError(f"RHT signs {signs!r} are {len(named)} long; the RHT size is {size}")
    return named


def operand_signs(spec) -> tuple[int, ...]:
    """The sign vector of a ``QuantSpec`` whose ``rht`` is on (its ``rht_key``)."""
    return sign_vector(*spec.rht_key)


def operand_rht(t: torch.Tensor, spec, axis: int) -> torch.Tensor:
    """``t`` as a GEMM operand under ``spec``'s RHT (``spec.rht`` on) along ``axis``: the fp32 transform, rounded
    to bf16 (RNE, kept in fp32) where ``spec.rht_output = "bf16"`` (torchao's NVFP4 training kernels). By
    ``round_to``: inductor may drop a ``.bfloat16().float()`` round trip (it does not emulate such casts)."""
    v = rht(t, operand_signs(spec), axis)
    return round_to(v, "bf16", saturate=False) if spec.rht_output == "bf16" else v


@functools.lru_cache(maxsize=64)
def _sign_vector(size: int, seed: int) -> tuple[int, ...]:
    check_size(size)
    with unset_fake_temporarily():  # values, also under the memory planner's fake tensors
        bits = random_bits((size,), derive_key("rht", size, seed))
        return tuple(1 - 2 * int(b) for b in (bits >> 31) & 1)


def hadamard_matrix(size: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix ``H[i][j] = (-1)**popcount(i & j)`` (float64, entries +-1)."""
    check_size(size)
    i = torch.arange(size)
    parity = torch.tensor([bin(v).count("1") & 1 for v in (i[:, None] & i[None, :]).flatten().tolist()])
    return (1 - 2 * parity).to(torch.float64).reshape(size, size)


COLUMNS_UP_TO = 64
"""Block sizes up to this run the butterfly on the block's ``size`` columns as separate tensors (a graph of
``size * log2(size)`` elementwise ops: inductor fuses it into one vectorized pass, 1.5-5x faster compiled
and faster eager than the staged form); larger sizes run log2(size) whole-tensor stages."""


def _butterfly(v: torch.Tensor, size: int, axis: int) -> torch.Tensor:
    """``H`` applied along dim ``axis + 1`` (of length ``size``) of v: log2(size) stages, each pairing the
    elements one bit apart as ``(a + b, a - b)``. Both forms below do the same fp32 adds in the same order
    per element, so they give the same bits."""
    if size <= COLUMNS_UP_TO:
        cols = list(v.unbind(axis + 1))
        h = 1
        while h < size:
            for i in range(size):
                if not i & h:
                    cols[i], cols[i + h] = cols[i] + cols[i + h], cols[i] - cols[i + h]
            h *= 2
        return torch.stack(cols, dim=axis + 1)
    h = 1
    while h < size:
        v = v.unflatten(axis + 1, (size // (2 * h), 2, h))
        a, b = v.select(axis + 2, 0), v.select(axis + 2, 1)
        v = torch.stack((a + b, a - b), dim=axis + 2).flatten(axis + 1, axis + 3)
        h *= 2
    return v


def rht(x: torch.Tensor, signs: tuple[int, ...], axis: int = -1) -> torch.Tensor:
    """``T`` applied to every block of ``len(signs)`` values along ``axis`` (fp32 result).

    Args:
        x: any tensor whose ``axis`` is a multiple of the block size (computed in fp32).
        signs: the sign vector (``sign_vector``); its length is the block size.
        axis: the dim the blocks run along (a GEMM operand's contraction dim).

    Returns:
        fp32 tensor of x's shape.

    Raises:
        ValueError: the block size does not divide the dim.
    """
    size = len(signs)
    check_size(size)
    if x.shape[axis] % size:
        raise ValueError(
            f"RHT size {size} does not divide dim {axis} of size {x.shape[axis]} ({tuple(x.shape)})"
        )
    axis = axis % x.dim()
    # Blocks stay in place (no transpose): dim axis becomes (blocks, size), the butterfly runs along size.
    s = sign_tensor(signs, x.device).reshape((size,) + (1,) * (x.dim() - axis - 1))
    v = _butterfly(x.to(torch.float32).unflatten(axis, (-1, size)) * s, size, axis)
    return (v * (1.0 / math.sqrt(size))).flatten(axis, axis + 1)  # exact for sizes 4**k


_SIGN_TENSORS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def sign_tensor(signs: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``signs`` as an fp32 tensor on ``device``, made once per (signs, device) and kept: a ``torch.tensor``
    per call would copy host-to-device at every cast, which a CUDA graph capture refuses (the first call,
    the capture's warm-up step, makes it). Traced or under a fake mode, made per call (``constants.kept``)."""
    key = (signs, torch.device(device))
    return kept(_SIGN_TENSORS, key, lambda: torch.tensor(signs, dtype=torch.float32, device=device))


def rht_reference(x: torch.Tensor, signs: tuple[int, ...], axis: int = -1) -> torch.Tensor:
    """The definition of ``rht``: x (in float64) times the dense block-diagonal matrix ``diag(s) H / sqrt(n)``.

    Returns:
        float64 tensor of x's shape.
    """
    size = len(signs)
    r = torch.diag(torch.tensor(signs, dtype=torch.float64)) @ hadamard_matrix(size) / math.sqrt(size)
    t = x.to(torch.float64).movedim(axis, -1)
    full = torch.block_diag(*[r] * (t.shape[-1] // size))  # (D, D): one R per block
    return (t @ full).movedim(-1, axis)
