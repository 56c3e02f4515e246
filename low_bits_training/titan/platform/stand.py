"""What every process that imports titan stands on, put in once by ``low_bits_training/titan/__init__.py``.

torchtitan 0.3.0 binds its ``device_type`` when ``torchtitan.tools.utils`` is first imported and several of
its modules copy it at their own import (``cpu.py``, adapter 1); torchao logs lines at import that no user
can act on (``noise.py``). Both must be in before the first torchtitan / torchao import, so they are put in
when titan itself is first imported, and every titan module may import torchtitan at its top.
"""

from __future__ import annotations

import importlib.util

from low_bits_training.titan.platform import cpu, noise


def stand() -> None:
    """Filter the upstream noise and, without an accelerator, point torchtitan at the CPU; a no-op the second
    time. Without torchtitan installed (the pure layers' test venvs) only the noise filter goes in.

    Raises:
        RuntimeError: a torchtitan module that copies ``device_type`` was imported before titan
            (``cpu.install_device_module``).
    """
    noise.install()
    if cpu.needs_cpu_adapters() and importlib.util.find_spec("torchtitan") is not None:
        cpu.install_device_module()
