"""Where torch's own fp8 cast kernels stand in for this package's rounding and coding of e4m3 / e5m2.

A round trip through ``torch.float8_e4m3fn`` / ``float8_e5m2`` rounds nearest-even with subnormals exactly as
``rounding.round_magnitude`` does (held bit for bit to the reference and ml_dtypes in tests) in one pass each way,
against ~6 for the add/sub trick; whether it is the faster route depends on the device, on eager vs
torch.compile (inductor's CPU backend vectorizes the casts but not bit reinterpretations) and on the torch
version (a float8_e4m3fn cast that does not saturate). The flags and dtype tuples here are read at call
time, so tests switch them to hold every route to the reference.
"""

from __future__ import annotations

import torch

from .table import Format

NATIVE_FP8_CASTS = True
"""Eager "nearest" to e4m3 / e5m2 through torch's cast kernels (tests switch this off to test the add/sub trick)."""


FP8_CAST_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
"""torch's fp8 dtypes whose casts round exactly as ``rounding`` does (tested)."""
COMPILED_CPU_CAST_DTYPES = (torch.float8_e4m3fn,)
"""The fp8 dtypes whose casts stand in under torch.compile on the CPU. torch 2.14's CPU vector library
converts e5m2 16 floats at a time only; a kernel that reads bf16 (training's activations, weights and
gradients) steps 32 at a time and converts e5m2 element by element, slower than the general route: a
1024 x 1024 e5m2 tensorwise cast of a bf16 tensor takes 0.8 ms on the general route against 1.3 ms with
the e5m2 cast (of an fp32 tensor the other way round, 1.1 against 0.5 ms; ``benchmarks/bench_formats.py
--size 1024 --reps 20 --only e5m2 [--dtype bfloat16]``). e4m3 converts 32 at a time."""


def native_fp8_dtype(fmt: Format, device: torch.device, saturate: bool = True) -> torch.dtype | None:
    """The torch fp8 dtype whose cast kernels may stand in for this package's rounding and coding of ``fmt``
    on ``device`` (nearest-even with subnormals; codes, NaN and -0 bit for bit; held to the reference and
    ml_dtypes in tests), else None. One pass each, vs ~6 for the add/sub trick. Eagerly on every device;
    under torch.compile on the CPU only, where inductor vectorizes the cast (and not the bit
    reinterpretations of the general route), and there for e4m3 only (``COMPILED_CPU_CAST_DTYPES``; which
    roundings take the round trip through the dtype: ``rounds_by_cast``). Not
    compiled for CUDA: Triton lacks fp8 on GPUs before sm89, and the general route fuses into the kernel
    there. ``saturate=False`` (overflow keeps the format's own inf / NaN) needs a format with inf: e4m3fn
    turns a value past its max into NaN, so it only stands in for saturating casts (the caller clamps
    first); e5m2 overflows to inf as ours does. The one answer for the casts (``round_to``), the optimizer's
    state codes (``optim.codec``) and the fp8 copies quantized layers keep for the backward
    (``nn.functional.stored``)."""
    dtype = getattr(fmt, "torch_dtype", None)
    if not (NATIVE_FP8_CASTS and dtype in FP8_CAST_DTYPES and (saturate or fmt.has_inf)):
        return None
    if compiling_for_cpu(device):
        return dtype if dtype in COMPILED_CPU_CAST_DTYPES else None
    return None if torch.compiler.is_compiling() else dtype


EAGER_CPU_ROUND_TRIP_DTYPES = (torch.float8_e5m2,)
"""The fp8 dtypes whose round trip (cast to fp8 and back to fp32) rounds eager CPU tensors
(``round_magnitude``). torch 2.14's CPU kernel converts e4m3 back to fp32 one element at a time (2.2 ms for
1024 x 768 against 0.3 ms for the cast to e4m3; e5m2 goes back through fp16's vector conversion, 0.3 ms), so
eager e4m3 takes the add/sub trick (0.7 ms for the whole rounding). Compiled, inductor converts both ways
in vector registers and e4m3 keeps the cast (``COMPILED_CPU_CAST_DTYPES``)."""


E4M3_CAST_SATURATES = bool(torch.tensor(1e4).to(torch.float8_e4m3fn).float() == 448.0)
"""Whether this torch's float8_e4m3fn cast saturates a value past 448 (torch 2.13 on), or makes it NaN
(torch 2.11 and 2.12: ``scripts/torch_range.sh``, docs/speed_model.md "Which torch"). Where it does not, a
saturating rounding does not take the cast (``rounds_by_cast``)."""


def rounds_by_cast(fmt: Format, device: torch.device, saturate: bool = True) -> bool:
    """True when ``round_magnitude`` rounds to ``fmt`` by a round trip through its torch fp8 dtype
    (``native_fp8_dtype``), except eagerly on the CPU for the dtypes whose way back is slow there
    (``EAGER_CPU_ROUND_TRIP_DTYPES``), and for e4m3 on a torch whose cast does not saturate
    (``E4M3_CAST_SATURATES``). The values are the same either way (tested)."""
    dtype = native_fp8_dtype(fmt, device, saturate)
    if dtype == torch.float8_e4m3fn and not E4M3_CAST_SATURATES:
        return False
    if dtype is None or torch.compiler.is_compiling() or device.type != "cpu":
        return dtype is not None
    return dtype in EAGER_CPU_ROUND_TRIP_DTYPES


def compiling_for_cpu(device: torch.device) -> bool:
    """True while torch.compile traces code for a CPU tensor (inductor's C++ backend: where bit
    reinterpretations run element by element and the fp8 casts vectorize)."""
    return device.type == "cpu" and torch.compiler.is_compiling()
