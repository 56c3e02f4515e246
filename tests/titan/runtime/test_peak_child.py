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


def test_a_second_plan_of_one_size_gets_its_own_meshes(monkeypatch, tmp_path, capsys):
    """CI of f56f8fe: after a compile and an autograd step (here gpu_check's, as the test order had them), a
    second 8-rank plan in one process was "not planned: ... Expected param's DTensor mesh to be the same mesh
    passed to fully_shard": DTensor's sharding-propagation cache, keyed by mesh equality, handed it the first
    plan's mesh. The planner empties those caches around each plan (``compat.forget_shardings``)."""
    from helpers import REPO, Scaled
    from low_bits_training.cli import speed
    from low_bits_training.speed.gpu_check import block, compiling, runner
    from low_bits_training.titan.launch import memory

    monkeypatch.setenv(
        "LBT_PEAK_CACHE", str(tmp_path / "plans")
    )  # planned here, not read from the suite's cache
    monkeypatch.setattr(memory, "_PLANS", {})
    monkeypatch.setattr(compiling, "_VARIANTS", [0])
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256):
        torch._dynamo.reset()
        for f in compiling.compile_variants([Scaled(k) for k in range(3)], backend=lambda gm, _: gm.forward):
            f(torch.ones(3))
        torch._dynamo.reset()
    shape = block.BlockShape(dim=128, n_heads=4, n_kv_heads=2, ffn=256, tokens=64)
    block.measure(runner.Context("cpu", REPO, float("inf")), ("bf16",), shape, ("eager",), repeats=1, iters=1)
    config = ["--config-file", "train_configs/debug_model.toml"]
    base = [*config, "--gpu", "H100", "--dump_folder", str(tmp_path)]
    lines = []
    for extra in (["--recipe", "mxfp8"], ["--dp", "1"], ["--dp", "8"]):
        assert speed.main([*base, *extra]) == 0
        lines += [x for x in capsys.readouterr().out.splitlines() if x.startswith("peak memory a rank")]
    assert len(lines) == 3 and all("GiB on rank 0" in x for x in lines), lines
