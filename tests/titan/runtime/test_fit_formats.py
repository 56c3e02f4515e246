"""The fit planner's format changes (issue 39: "which saved-activation rule, which optimizer-state formats"):
the blocks' saved activations in e4m3 and smaller AdamW states, offered after the changes that keep the
numbers and before a smaller batch, planned through the run's own hooks and optimizers, and undone after
(``titan/runtime/peak_fit.py``). The ranked table through lbt-doctor --fit: tests/cli/test_doctor.py."""

from __future__ import annotations

from helpers import CORPUS, DEBUG_TOML, REPO
from low_bits_training.titan.launch.validate import model_as_trained
from low_bits_training.titan.launch.worker import build_config
from low_bits_training.titan.runtime.peak import plan_peak
from low_bits_training.titan.runtime.peak_fit import SAVED_E4M3, _candidates, _changed

INT8 = 'optimizer_name = "LowBitAdamW" in optimizer.param_groups[0] (int8 moments)'
FOUR = (
    'exp_avg = "e2m1_block128", exp_avg_sq = "int4_block128" in optimizer.param_groups[0] '
    'with optimizer_name = "LowBitAdamW"'
)
SHAPE = ["--training.local_batch_size", "4", "--training.seq_len", "256"]


def _config(tmp_path, toml):
    where = ["--dump_folder", str(tmp_path), "--dataloader.dataset_path", str(CORPUS)]
    return build_config(["--config-file", str(toml), *SHAPE, *where])


def test_offered_after_the_exact_changes_and_before_the_batch(tmp_path):
    config = _config(tmp_path, DEBUG_TOML)
    assert [flags for flags, _ in _candidates(config, 1)] == [
        "--activation_checkpoint selective",
        "--activation_checkpoint full",
        SAVED_E4M3,
        INT8,
        FOUR,
        "--training.local_batch_size 2 --training.global_batch_size 4",
        "--training.local_batch_size 1 --training.global_batch_size 4",
    ]
    # the lean preset already saves in e4m3 and holds 4-bit moments: neither is offered again
    lean = [
        flags for flags, _ in _candidates(_config(tmp_path, REPO / "train_configs" / "debug_lean.toml"), 1)
    ]
    assert not {SAVED_E4M3, INT8, FOUR} & set(lean)


def test_each_planned_through_the_runs_hooks_and_optimizers_and_undone_after(tmp_path):
    config = _config(tmp_path, DEBUG_TOML)
    changes = dict(_candidates(config, 1))
    fn, optimizer, group = (
        config.model_spec.parallelize_fn,
        config.optimizer,
        config.optimizer.param_groups[0],
    )
    kwargs = dict(group.optimizer_kwargs)

    def parts(change=None):
        if change is None:
            return plan_peak(config, 1, "cpu", model_as_trained).parts
        with _changed(config, changes[change]):
            return plan_peak(config, 1, "cpu", model_as_trained).parts

    base, e4m3, int8, four = parts(), parts(SAVED_E4M3), parts(INT8), parts(FOUR)
    params = base["parameters"]  # fp32: 4 bytes a parameter
    # torch's AdamW holds two fp32 moments; int8 blocks of 128 with an fp32 scale hold 2 x (1 + 4/128) bytes,
    # 4-bit ones 2 x (0.5 + 4/128); the norms' few moments stay fp32 (under min_quantized_numel)
    assert 0 <= base["optimizer states"] - 2 * params < 1024  # and a 4-byte step per tensor
    assert 2 * 1.03125 / 4 < int8["optimizer states"] / params < 2 * 1.03125 / 4 * 1.01
    assert 2 * 0.53125 / 4 < four["optimizer states"] / params < 2 * 0.53125 / 4 * 1.02
    # e4m3 saves keep a byte of each saved fp32 value (and a scale per row): the forward and backward shrinks
    assert e4m3["forward and backward"] < 0.75 * base["forward and backward"]
    assert e4m3["optimizer states"] == base["optimizer states"]
    # undone: the spec's parallelize_fn, the optimizer's container, the group's name and kwargs
    assert config.model_spec.parallelize_fn is fn and config.quantize.saved == []
    assert config.optimizer is optimizer and group.optimizer_name == "AdamW"
    assert group.optimizer_kwargs == kwargs
