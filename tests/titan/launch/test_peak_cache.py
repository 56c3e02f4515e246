"""Plans kept between processes (``titan/launch/peak_cache.py``, ``LBT_PEAK_CACHE``): a run that differs only
in what the planner never reads gets the kept plan; one that differs in what it reads is planned again; unset,
nothing is kept."""

from __future__ import annotations

from helpers import DEBUG_TOML
from low_bits_training.titan.launch import peak_cache
from low_bits_training.titan.launch.configure import load_config


def _key(*flags: str) -> str:
    return peak_cache.plan_key(load_config(str(DEBUG_TOML), list(flags)), 1, "cpu", 0)


def test_the_key_leaves_out_only_what_the_planner_never_reads():
    base = _key()
    assert _key("--dump_folder", "/elsewhere", "--training.steps", "7", "--debug.seed", "3") == base
    assert (
        _key("--metrics.log_freq", "1", "--checkpoint.interval", "3", "--lr_scheduler.warmup_steps", "1")
        == base
    )
    assert _key("--training.local_batch_size", "4") != base
    assert _key("--activation_checkpoint", "full") != base
    assert _key("--quantize.recipe", "mxfp8") != base
    assert _key("--compile.enable") != base  # planned alike today, but kept apart in case that changes
    assert peak_cache.plan_key(load_config(str(DEBUG_TOML), []), 2, "cpu", 0) != base  # the ranks


def test_a_kept_plan_is_given_back_and_a_new_key_is_planned(monkeypatch, tmp_path):
    calls = []

    def make(value):
        def run():
            calls.append(value)
            return {"peak": value}

        return run

    monkeypatch.delenv(peak_cache.PEAK_CACHE_ENV, raising=False)
    assert peak_cache.kept("a", make(1)) == {"peak": 1} and peak_cache.kept("a", make(2)) == {"peak": 2}
    assert not list(tmp_path.iterdir())  # unset: nothing kept

    monkeypatch.setenv(peak_cache.PEAK_CACHE_ENV, str(tmp_path / "plans"))
    assert peak_cache.kept("a", make(3)) == {"peak": 3}
    assert peak_cache.kept("a", make(4)) == {"peak": 3}  # kept: not planned again
    assert peak_cache.kept("b", make(5)) == {"peak": 5}
    assert calls == [1, 2, 3, 5] and len(list((tmp_path / "plans").glob("*.pkl"))) == 2
    assert not list((tmp_path / "plans").glob("*.tmp"))  # written through a rename
