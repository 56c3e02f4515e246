"""Counter-based random bits: a pure function of (key, element index), the same eager and compiled.

Stochastic rounding needs random numbers that are (1) reproducible from values a checkpoint already holds,
(2) identical under torch.compile and in eager mode, and (3) free of generator objects, which torch.compile
cannot put in a graph. A counter-based generator gives all three: the random word of element ``i`` is a
hash of ``(key, i)``; nothing is carried from one call to the next.

The hash is Chris Wellons' ``lowbias32`` integer mixer (two xor-shift-multiply rounds, full avalanche),
applied twice with two 32-bit halves of the key folded in. ``random_bits`` computes it in int64 arithmetic
on values below 2**32, with each 32-bit multiply split into 16-bit halves so no intermediate overflows: the
reference form. ``uniform`` and ``uniform_int`` (what stochastic rounding draws) compute the same words in
int32 two's complement (``_words32``: wrapping multiplies and adds, masked shifts; inductor's C++ does
integer multiplies and adds in unsigned arithmetic, so wrapping is defined there too): 16 lanes per vector
instead of 8 and one multiply instead of three, and the same bits (tested, eager and compiled).

Keys: ``derive_key(*parts)`` turns any identifying values (seed, step, layer name, role, rank, ...) into a
63-bit int by a cryptographic hash; ``fold_key(key, *ints)`` mixes small ints into a key *tensor* inside a
graph (a layer's role, a chunk index) without leaving it.
"""

from __future__ import annotations

import hashlib

import torch

MASK32 = 0xFFFFFFFF
_M1, _M2 = 0x7FEB352D, 0x846CA68B  # lowbias32 multipliers
RandomSource = torch.Generator | torch.Tensor | None
"""Where stochastic rounding takes its randomness: a ``torch.Generator`` (torch's RNG), an int64 key tensor
(counter-based, this module), or None (torch's global RNG)."""


def derive_key(*parts: object) -> int:
    """A 63-bit key from identifying values (their ``str``), by blake2b: the one seed-derivation scheme.

    Args:
        *parts: e.g. ``(seed, step, rank)`` or ``(seed, fqn, step, offset, purpose)``.

    Returns:
        An int in [0, 2**63).
    """
    text = "|".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) and a 32-bit constant c, without int64 overflow."""
    lo, hi = x & 0xFFFF, x >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32: a bijective avalanche mix of int64 values in [0, 2**32) (result in the same range)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _M1)
    x = x ^ (x >> 15)
    x = _mul32(x, _M2)
    return x ^ (x >> 16)


_M2_I32 = _M2 - (1 << 32)  # the same 32 bits as an int32 constant


def _to_int32(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) to the int32 with the same 32 bits (no overflowing conversion)."""
    return (((x + (1 << 31)) & MASK32) - (1 << 31)).to(torch.int32)


def _mix32_i32(x: torch.Tensor) -> torch.Tensor:
    """``mix32`` on int32 words (the same 32 bits in, the same 32 bits out)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * _M1
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * _M2_I32
    return x ^ ((x >> 16) & 0xFFFF)


def _key_words(key: torch.Tensor | int, device) -> tuple[torch.Tensor, torch.Tensor, torch.device | None]:
    """The two mixed 32-bit key words (int64 0-d tensors) and the output device (default: the key
    tensor's, else CPU)."""
    if isinstance(key, torch.Tensor):
        device = key.device if device is None else device
        key = key.reshape(()).to(device=device, dtype=torch.int64)
    key = torch.as_tensor(key, dtype=torch.int64, device=device)
    k1 = mix32(key & MASK32)
    return k1, mix32(((key >> 32) ^ k1) & MASK32), device


def _words32(shape: tuple[int, ...] | torch.Size, key: torch.Tensor, device) -> torch.Tensor:
    """``random_bits(shape, key)`` as int32 words (the same bits). Computed in int32 below 2**31 elements
    (int32 indices); larger draws convert ``random_bits``' words."""
    n = torch.Size(shape).numel()
    if n >= 2**31:
        return _to_int32(random_bits(shape, key, device))
    k1, k2, device = _key_words(key, device)
    i = torch.arange(n, dtype=torch.int32, device=device)
    return _mix32_i32(_mix32_i32(i ^ _to_int32(k1)) + _to_int32(k2)).reshape(shape)


def fold_key(key: torch.Tensor | int, *ints: int) -> torch.Tensor | int:
    """Mix small non-negative ints into a key (an int64 tensor stays a tensor, an int stays an int).

    Used inside compiled graphs: a layer's key tensor plus the role index gives the role's key.
    """
    for v in ints:
        if isinstance(key, torch.Tensor):
            key = (key * 0x9E3779B1 + (v + 1)) & ((1 << 62) - 1)
        else:
            key = derive_key(key, v)
    return key


def random_bits(shape: tuple[int, ...] | torch.Size, key: torch.Tensor | int, device=None) -> torch.Tensor:
    """Uniform 32-bit random words (int64 in [0, 2**32)), one per element, a pure function of (key, index).

    Args:
        shape: output shape; element ``i`` (row-major) gets word ``hash(key, i)``.
        key: int64 tensor (0-d or 1 element, any device) or int; only its low 62 bits are used.
        device: output device (default: the key tensor's, else CPU).

    Returns:
        int64 tensor of ``shape``.
    """
    k1, k2, device = _key_words(key, device)
    i = torch.arange(torch.Size(shape).numel(), dtype=torch.int64, device=device) & MASK32
    return mix32((mix32(i ^ k1) + k2) & MASK32).reshape(shape)


def uniform(shape: tuple[int, ...] | torch.Size, source: RandomSource, device=None) -> torch.Tensor:
    """fp32 uniform values in [0, 1) on a 2**-24 grid, from a key (counter-based) or a generator.

    Args:
        shape: output shape.
        source: int64 key tensor, ``torch.Generator`` or None (global RNG).
        device: output device.

    Returns:
        fp32 tensor of ``shape``.
    """
    if isinstance(source, torch.Tensor):
        return ((_words32(shape, source, device) >> 8) & 0xFFFFFF).to(torch.float32) * 2.0**-24
    return torch.rand(shape, generator=source, device=device, dtype=torch.float32)


def uniform_int(
    shape: tuple[int, ...] | torch.Size, bits: int, source: RandomSource, device=None
) -> torch.Tensor:
    """int32 uniform integers in [0, 2**bits) (1 <= bits <= 31), from a key or a generator.

    Args:
        shape: output shape.
        bits: number of random bits.
        source: int64 key tensor, ``torch.Generator`` or None (global RNG).
        device: output device.

    Returns:
        int32 tensor of ``shape``.
    """
    if isinstance(source, torch.Tensor):
        return (_words32(shape, source, device) >> (32 - bits)) & ((1 << bits) - 1)
    return torch.randint(0, 1 << bits, shape, generator=source, dtype=torch.int32, device=device)
