"""Every private upstream name in ``titan/platform/compat.py``: still where it was and unchanged (the test
fails when upstream changes it, so the shim is looked at again), and each shim still does what we use it
for."""

from __future__ import annotations

import pytest
import torch

from low_bits_training.titan.platform import compat


@pytest.mark.parametrize("name", sorted(n for n, u in compat.UPSTREAM.items() if u.digest))
def test_upstream_source_is_the_one_the_shim_was_written_for(name):
    up = compat.UPSTREAM[name]
    line, digest = compat.source_digest(compat.resolve(up.target))
    assert (line, digest) == (up.line, up.digest), (
        f"{up.target} changed upstream (now line {line}, digest {digest}): re-check compat.{name} "
        f"({up.why}), then update UPSTREAM"
    )


def test_every_private_name_in_the_package_goes_through_compat():
    # The modules that used private upstream names before compat.py existed now import the shims instead.
    import inspect

    from low_bits_training.titan.launch import configure
    from low_bits_training.titan.runtime import checkpoint, metrics, profiling

    for module in (checkpoint, configure, metrics, profiling):
        source = inspect.getsource(module)
        for private in ("_load_config(", "_get_metrics_rank", "_is_profiler_enabled", "_find_load_step("):
            assert private not in source, (module.__name__, private)


def test_find_load_step_and_checkpoint_path(tmp_path):
    ck = tmp_path / "checkpoint"
    assert compat.find_load_step(str(ck)) == -1  # no folder
    for step, complete in ((2, True), (4, True), (6, False)):  # step-6 is half-written: no .metadata
        (ck / f"step-{step}").mkdir(parents=True)
        if complete:
            (ck / f"step-{step}" / ".metadata").write_bytes(b"x")
    assert compat.find_load_step(str(ck)) == 4
    assert compat.checkpoint_path(str(ck), 4) == str(ck / "step-4")


def test_profiler_running_flag():
    assert not compat.profiler_running()
    with torch.profiler.profile():
        assert compat.profiler_running()
    assert not compat.profiler_running()


def test_memory_categories_in_torchs_order():
    assert compat.memory_categories() == (
        "parameter", "optimizer_state", "input", "temporary", "activation", "gradient", "autograd_detail",
        "unknown",
    )  # fmt: skip


def test_config_function_and_metrics_rank():
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.trainer import Trainer

    assert isinstance(compat.config_function("llama3", "llama3_debugmodel"), Trainer.Config)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    assert compat.metrics_rank(dims, "1F1B") == 0


class _Base:
    def _build_metric_logger(self, **kwargs):
        return ("upstream", kwargs["dump_folder"])

    def _save(self, curr_step, last_step=False):
        return True

    def _load(self, step=-1):
        if step == 99:
            raise EOFError("truncated")
        return True


def test_hooks_wrap_the_upstream_methods():
    class Metrics(compat.MetricLoggerHook, _Base):
        def wrap_metric_logger(self, inner, **kwargs):
            return ("ours", inner)

    assert Metrics()._build_metric_logger(dump_folder="d") == ("ours", ("upstream", "d"))

    calls = []

    class Ckpt(compat.CheckpointHooks, _Base):
        def after_save(self, step):
            calls.append(("saved", step))

        def before_load(self, step):
            calls.append(("before", step))

        def after_load(self, loaded):
            calls.append(("after", loaded))

        def load_error(self, error):
            return RuntimeError(f"one line: {error}")

    c = Ckpt()
    assert c._save(4) and c._load(-1)
    with pytest.raises(RuntimeError, match="one line: truncated"):
        c._load(99)
    assert calls == [("saved", 4), ("before", -1), ("after", True), ("before", 99)]


def test_inductor_as_eager_names_inductors_own_switches():
    import torch._inductor.config as inductor

    assert compat.UPSTREAM["inductor_as_eager"].target == "torch._inductor.config:_config"
    with inductor.patch(dict.fromkeys(compat.INDUCTOR_AS_EAGER, False)):
        assert compat.inductor_as_eager() == ()  # torch 2.14.1 has all three
        assert all(getattr(inductor, name) is True for name in compat.INDUCTOR_AS_EAGER)


def test_compile_in_this_process_sets_inductors_own_thread_count():
    import torch._inductor.config as inductor

    assert compat.UPSTREAM["inductor_compile_threads"].target == "torch._inductor.config:_config"
    assert "compile_threads" in inductor._config
    with inductor.patch(compile_threads=2):
        compat.compile_in_this_process()
        assert inductor.compile_threads == 1
