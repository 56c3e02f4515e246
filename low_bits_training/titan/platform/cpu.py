"""The four adapters torchtitan 0.3.0 needs on a machine without an accelerator.

Applied only when no accelerator is present (see ``needs_cpu_adapters``); each one names the upstream line it
answers, and ``tests/titan/platform/test_cpu_adapters.py`` fails when upstream stops needing it.

1. ``torchtitan.tools.utils.device_type`` is ``_get_available_device_type() or "cuda"`` (tools/utils.py ~55),
   bound at import and copied by ``from ... import device_type`` into metrics, distributed utils, parallel
   dims and the profiler. ``install_device_module`` sets it to ``"cpu"`` with a CPU device module before any
   of those modules are imported.
2. FlexAttention has no backward on CPU (torch 2.14.1 raises ``NotImplementedError``) and torchtitan refuses
   ``attn_backend="sdpa"`` for language models (models/common/config_utils.py ~97). ``DenseMaskAttention``
   is a FlexAttention that turns the BlockMask's ``mask_mod`` into a dense boolean mask and calls SDPA: the
   same mask, so the same numbers up to SDPA's summation order.
3. torchtitan sets FSDP2's gradient divide factor to 1.0 (distributed/fsdp.py ``disable_fsdp_gradient_division``),
   which makes FSDP2 reduce with ``ReduceOp.PREMUL_SUM``; gloo refuses it. ``with_sum_reductions`` wraps the
   model's ``parallelize_fn`` and sets ``set_force_sum_reduction_for_comms(True)`` on each FSDP module (the
   factor is 1.0, so the numbers do not change).
4. torchtitan builds each step's BlockMask with ``torch.compile(create_block_mask)`` (models/common/attention.py
   ``create_attention_mask``, imported by name into models/common/decoder.py). Adapter 2 reads only the
   mask's ``mask_mod``, yet the compile cost every CPU run 3-5 s of its first step (measured on this
   2-core machine, seq 128; the eager call takes about 1 ms). ``build_masks_eagerly`` points the decoder's name
   at the uncompiled ``create_block_mask``: the same BlockMask, block for block.
"""

from __future__ import annotations

import dataclasses
import functools
import resource
import sys
import types
from dataclasses import dataclass
from typing import Any

import torch

# Modules that copy ``device_type`` / ``device_module`` at import time (found by grep over torchtitan 0.3.0).
_COPIERS = (
    "torchtitan.components.metrics",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.models.common.token_dispatcher",
    "torchtitan.tools.profiler",
    "torchtitan.trainer",
)


def needs_cpu_adapters() -> bool:
    """True when no accelerator (CUDA, ROCm, XPU, MPS, ...) is visible to torch."""
    return not torch.accelerator.is_available()


def _peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux; VmHWM (reset by clear_refs) is preferred when readable.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak_rss() -> None:
    # Writing "5" to clear_refs resets VmHWM (Linux >= 4.0); elsewhere the peak is since process start.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _total_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) * 1024
    except OSError:
        return 0


class _CpuProperties:
    name = "cpu"

    @property
    def total_memory(self) -> int:
        return _total_memory_bytes()


def _make_cpu_device_module() -> types.ModuleType:
    """A stand-in for ``torch.cuda`` with what torchtitan calls; memory is the process's resident set."""
    mod = types.ModuleType("low_bits_training_cpu_device")
    mod.current_device = lambda: 0
    mod.device_count = lambda: 1
    mod.set_device = lambda device: None
    mod.synchronize = lambda device=None: None
    mod.empty_cache = lambda: None
    mod.get_device_name = lambda device=None: "cpu"
    mod.get_device_properties = lambda device=None: _CpuProperties()
    mod.reset_peak_memory_stats = lambda device=None: _reset_peak_rss()
    mod.is_available = lambda: True

    def memory_stats(device=None) -> dict[str, int]:
        peak = _peak_rss_bytes()
        return {
            "active_bytes.all.peak": peak,
            "reserved_bytes.all.peak": peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    mod.memory_stats = memory_stats
    return mod


def install_device_module() -> None:
    """Point torchtitan's ``device_type``/``device_module`` at the CPU (adapter 1); a no-op once it is in.

    Raises:
        RuntimeError: a torchtitan module that copies ``device_type`` was imported before this call, so it
            already holds ``"cuda"``.
    """
    tt = sys.modules.get("torchtitan.tools.utils")
    if getattr(tt, "device_type", None) == "cpu":
        return  # already in (the launcher's check, then doctor's, in one process)
    early = [m for m in _COPIERS if m in sys.modules]
    if early:
        raise RuntimeError(
            f"CPU adapter applied too late: {early} already imported; import low_bits_training.titan (it "
            "points torchtitan at the CPU: titan/platform/stand.py) before any torchtitan module"
        )
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = "cpu"  # upstream: tools/utils.py ~60, "cuda" when no accelerator
    tt_utils.device_module = _make_cpu_device_module()


def repoint_at_cpu() -> None:
    """Point torchtitan at the CPU in a process where it already holds an accelerator (``device_type`` and
    ``device_module`` in ``torchtitan.tools.utils`` and in every module of ``_COPIERS`` already imported). For
    the memory planner's forked child on a GPU node (``titan/runtime/peak_fit.py``): its meshes and tensors
    are the CPU's and fake, and a forked child may not initialize CUDA."""
    import torchtitan.tools.utils as tt_utils

    module = _make_cpu_device_module()
    for name in ("torchtitan.tools.utils", *_COPIERS):
        held = sys.modules.get(name)
        if held is not None:
            for attr, value in (("device_type", "cpu"), ("device_module", module)):
                if hasattr(held, attr):
                    setattr(held, attr, value)
    tt_utils.device_type, tt_utils.device_module = "cpu", module


@functools.cache
def _dense_attention_class():
    # Built lazily so that importing this module does not import torchtitan's model code (adapter 1 first).
    from torch.nn.attention.flex_attention import create_mask
    from torchtitan.models.common.attention import FlexAttention

    class DenseMaskAttention(FlexAttention):
        """FlexAttention's interface and mask, computed by SDPA with a dense boolean mask (CPU adapter 2)."""

        @dataclass(kw_only=True, slots=True)
        class Config(FlexAttention.Config):
            pass

        def forward(
            self,
            q_BLNH,
            k_BLNH,
            v_BLNH,
            *,
            attention_masks,
            score_mod=None,
            scale=None,
            enable_gqa=False,
            out_transform=None,
            **kwargs,
        ):
            if score_mod is not None or out_transform is not None:
                raise NotImplementedError(
                    "DenseMaskAttention (CPU) supports neither score_mod nor out_transform"
                )
            q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))  # (B, N, L, H)
            B, _, L, _ = q.shape
            mask = create_mask(attention_masks.mask_mod, B, 1, L, k.shape[2], device=q.device)  # (B, 1, L, S)
            return self.attend(q, k, v, mask, scale, enable_gqa).transpose(1, 2)  # (B, L, N, H)

        def attend(self, q, k, v, mask, scale, enable_gqa):
            """Attention of (B, N, L, H) tensors under a dense bool mask (B, 1, L, S); the quantized
            attention (``titan.targets.attention``) overrides this."""
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
            )

    return DenseMaskAttention


def use_dense_mask_attention(model_config) -> int:
    """Replace every FlexAttention config in a model config tree by ``DenseMaskAttention`` (adapter 2).

    Returns:
        How many attention configs were replaced.
    """
    from torchtitan.models.common.attention import FlexAttention

    dense = _dense_attention_class()
    hits = [h for h in model_config.traverse(FlexAttention.Config) if not isinstance(h[1], dense.Config)]
    for _, cfg, parent, attr in hits:
        new = dense.Config(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
        if isinstance(parent, list):
            parent[attr] = new
        else:
            setattr(parent, attr, new)
    return len(hits)


def force_sum_reductions(model: torch.nn.Module) -> int:
    """Make every FSDP2 module reduce with SUM instead of PREMUL_SUM (adapter 3). Returns the count."""
    from torch.distributed.fsdp import FSDPModule

    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.set_force_sum_reduction_for_comms(True)
    return len(mods)


def with_sum_reductions(parallelize_fn):
    """Wrap a torchtitan ``parallelize_fn`` so the FSDP2 modules it makes reduce with SUM (adapter 3)."""

    @functools.wraps(parallelize_fn)
    def wrapped(model, *args, **kwargs):
        model = parallelize_fn(model, *args, **kwargs)
        force_sum_reductions(model)
        return model

    wrapped.__lbt_sum_reductions__ = True
    return wrapped


def build_masks_eagerly() -> None:
    """Make torchtitan's decoder build its BlockMask without ``torch.compile`` (adapter 4, process-wide)."""
    import torchtitan.models.common.decoder as decoder
    from torch.nn.attention.flex_attention import create_block_mask

    decoder.create_attention_mask = create_block_mask  # upstream: a torch.compile'd create_block_mask


def adapt_trainer_config(config) -> None:
    """Apply adapters 2 and 3 to a ``Trainer.Config`` in place, and adapter 4 (adapter 1 is process-wide)."""
    spec = config.model_spec
    if spec is None:
        return
    use_dense_mask_attention(spec.model)
    build_masks_eagerly()
    if not getattr(spec.parallelize_fn, "__lbt_sum_reductions__", False):
        spec.parallelize_fn = with_sum_reductions(spec.parallelize_fn)


STAGED = {"c10d::_allgather_base_", "c10d::_reduce_scatter_base_"}
"""The collectives FSDP2 calls (``all_gather_into_tensor``, ``reduce_scatter_tensor``) that gloo runs through a
buffer of the whole tensor (the gathered output, the unreduced input) where NCCL works in place."""


def gloo_staging(func: Any, args: tuple) -> int:
    """Bytes gloo allocates and frees inside ``func(*args)`` on CPU ranks: the largest tensor of a ``STAGED``
    collective (its whole gathered or unreduced tensor), 0 for any other op. The memory planner counts it where
    the ranks run on the CPU (``titan/runtime/peak.py``); ``tests/titan/platform/test_gloo_staging.py`` holds
    it to the allocator's peak of both collectives on 2 gloo ranks."""
    if getattr(func, "name", None) is None or func.name() not in STAGED:
        return 0
    return max((a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor)), default=0)
