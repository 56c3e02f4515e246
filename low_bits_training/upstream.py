"""The private torch names the floors below titan use (nn, optim), each behind one name here.

``titan/platform/compat.py`` is the guard of every private torch / torchtitan / torchao name; the floors below
titan may not import it (the arrow, tests/test_layering.py), so the few private torch names they need live here,
beside ``errors``, with the same record: where the name stood in the pinned torch (2.14.1) and a digest of its
source. compat merges ``RECORDS`` into its ``UPSTREAM``, so ``tests/titan/platform/test_compat.py`` fails when torch
changes any of them, as it does for compat's own shims. No other module of the package reaches a private
upstream name (``tests/titan/platform/test_private_names.py``).

Everything is read at call time (``torch.cpu``'s probes are looked up when called), so a test that patches the
private name patches what the package sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.utils._python_dispatch import TorchDispatchMode


@dataclass(frozen=True)
class Upstream:
    """One private upstream name we rely on."""

    target: str
    """``module:qualname``."""
    line: int
    """First line of its definition in the pinned version."""
    digest: str
    """First 16 hex digits of the sha256 of its source in the pinned version ("" for a flag without source)."""
    why: str
    """What we use it for."""


__all__ = [
    "INDUCTOR_AS_EAGER",
    "RECORDS",
    "TorchDispatchMode",
    "Upstream",
    "compute_local_shape_and_global_offset",
    "cpu_has",
    "has_kernel",
    "has_triton",
    "inductor_as_eager_here",
    "unset_fake_temporarily",
]

INDUCTOR_AS_EAGER = (
    "emulate_precision_casts",
    "eager_numerics.division_rounding",
    "eager_numerics.disable_ftz",
)
"""Inductor's switches (all off by default) that keep compiled code bit-faithful to eager on a GPU: round
low-precision intermediates where eager does; lower fp32 ``x / y`` to a correctly rounded divide (Triton's default
``div.full.f32`` is approximate, so ``x / scale`` with a scale that is not a power of two could land on another
grid point); keep fp32 subnormals (Triton flushes them to zero by default). The emulation's compile turns them on
process-wide (``compat.inductor_as_eager``), the fused optimizer update per compile (``optim/fused.py``)."""


def inductor_as_eager_here() -> dict[str, bool]:
    """``INDUCTOR_AS_EAGER`` as ``torch.compile`` options, each True: those this torch has (torch.compile refuses
    an unknown option, and the pure layers run on torch 2.11 too)."""
    import torch._inductor.config as inductor

    return {name: True for name in INDUCTOR_AS_EAGER if name in inductor._config}


def has_triton() -> bool:
    """Whether Triton can compile for the current device (torch's own probe; imports triton, so called late)."""
    from torch.utils import _triton

    return _triton.has_triton()


def has_kernel(op: str, dispatch_key: str) -> bool:
    """Whether the registered operator ``op`` (``"ns::name"``) has a kernel for ``dispatch_key``."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op, dispatch_key)


_CPU_PROBES = {"amx": "_is_amx_tile_supported", "avx512_bf16": "_is_avx512_bf16_supported"}


def cpu_has(feature: str) -> bool:
    """Whether this CPU has ``feature`` ("amx" tiles or "avx512_bf16" dot products); False where torch has no probe."""
    return bool(getattr(torch.cpu, _CPU_PROBES[feature], lambda: False)())


RECORDS: dict[str, Upstream] = {
    "dispatch_has_kernel": Upstream(
        "torch._C:_dispatch_has_kernel_for_dispatch_key",
        0,
        "",  # a C function: tests/titan/platform/test_gpu_path.py checks what it says for a known op
        "whether torchao's compiled MXFP8 dim-1 cast has a CUDA kernel (nn/hardware.py mxfp8_cuda_cast_built)",
    ),
    "dtensor_local_offset": Upstream(
        "torch.distributed.tensor._utils:compute_local_shape_and_global_offset",
        93,
        "bd20cb9d5463d478",
        "where a rank's DTensor shard starts and how long it is (optim/dist.py)",
    ),
    "cpu_amx": Upstream(
        "torch.cpu:_is_amx_tile_supported",
        102,
        "cd8eeae518a7a395",
        "whether the CPU has AMX tiles (nn/kernels.py cpu_bf16_gemm)",
    ),
    "cpu_avx512_bf16": Upstream(
        "torch.cpu:_is_avx512_bf16_supported",
        91,
        "28fa7aa703299622",
        "whether the CPU has AVX512-BF16 dot products (nn/kernels.py cpu_bf16_gemm)",
    ),
    "has_triton": Upstream(
        "torch.utils._triton:has_triton",
        208,
        "c77cb696cc0f4bef",
        "whether Triton can compile here (nn/hardware.py detect_hardware)",
    ),
    "unset_fake": Upstream(
        "torch._subclasses.fake_tensor:unset_fake_temporarily",
        213,
        "8310fcc18043ace9",
        "shape arithmetic on real tensors under the memory planner's fake mode (optim/dist.py, optim/codec.py)",
    ),
    "dispatch_mode": Upstream(
        "torch.utils._python_dispatch:TorchDispatchMode",
        72,
        "3c4d4a7804016d56",
        "the memory planner's count of every storage an op makes (optim/memory.py LiveStorages)",
    ),
    "inductor_as_eager": Upstream(
        "torch._inductor.config:_config",
        0,
        "",  # settings, not code: tests/titan/platform/test_compat.py checks each name of INDUCTOR_AS_EAGER is a key
        "inductor's switches that make compiled code round, divide and keep subnormals as eager does (the "
        "emulation's compile, titan/platform/compat.py; the fused optimizer update, optim/fused.py)",
    ),
}
"""The records of the names above, by compat's key (merged into ``compat.UPSTREAM``)."""
