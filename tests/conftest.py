"""Test session setup: CPU adapters before any torchtitan import, one inductor cache per session."""

import os
import tempfile

# One compiled-graph cache per test session (../shared/DESIGN.md: stale entries crash torchao's low-bit optimizers).
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="lbt-inductor-"))
os.environ.setdefault("OMP_NUM_THREADS", "2")

from low_bits_training.titan import cpu  # noqa: E402

if cpu.needs_cpu_adapters():
    cpu.install_device_module()
