"""The planner's forked child (``peak_fit.in_child``) compiles even when its parent compiled before the fork.

The optimizer's workspace is measured on a real, compiled step in the child (``optim/workspace.py``). A parent
that had compiled holds inductor's thread pool, whose threads a fork does not copy: the child's first compile
waited on them until ``CHILD_SECONDS`` (600 s) ran out (seen in a test process with a cold kernel cache:
``lbt-doctor``'s check planned in the test process after other tests had compiled)."""

from __future__ import annotations

import random

import pytest
import torch

from low_bits_training.titan.runtime import peak_fit


def _fresh_kernel(c: float):
    """A compiled function whose C++ kernel no cache holds (``c`` is a constant of its code)."""
    return torch.compile(lambda x: (x * c + 0.5).sin(), backend="inductor", fullgraph=True)


def test_a_forked_planner_compiles_after_its_parent_compiled(monkeypatch, tmp_path):
    import torch._inductor.config as inductor

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # nothing on disk either
    monkeypatch.setattr(
        peak_fit, "CHILD_SECONDS", 120
    )  # the hang, if back, fails here instead of waiting 600 s
    c_parent, c_child = (1.0 + random.random() for _ in range(2))
    with inductor.patch(compile_threads=2):
        x = torch.linspace(-1, 1, 16)
        assert torch.allclose(_fresh_kernel(c_parent)(x), (x * c_parent + 0.5).sin())  # the pool is started
        got = peak_fit.in_child(lambda: _fresh_kernel(c_child)(x).tolist())
    assert got == pytest.approx((x * c_child + 0.5).sin().tolist(), abs=1e-6)
