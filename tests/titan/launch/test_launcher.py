"""The launcher: torchrun's options and the training arguments, the failure it reports, the one-line forms of
tyro's errors, and a non-finite stop on 2 ranks ending in exit code 3 with one line."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from helpers import DEBUG_TOML, train, write_toml
from low_bits_training.config.flags import tyro_message
from low_bits_training.errors import ConfigError
from low_bits_training.titan.launch import failures, launcher, torchrun
from low_bits_training.titan.launch.configure import load_config, read_toml


def test_torchrun_options_and_training_arguments():
    assert launcher.split_argv(["--nproc_per_node=2", "--", "--a", "1"]) == (
        ["--nproc_per_node=2"],
        ["--a", "1"],
    )
    assert launcher.split_argv(["--a", "1"]) == ([], ["--a", "1"])
    args = torchrun.torchrun_args(["--nnodes=2", "--nproc_per_node=4"], ["--training.steps", "3"])
    assert torchrun.world_size(args) == 8
    assert args.training_script == torchrun.WORKER and args.training_script_args == ["--training.steps", "3"]


def _failure(code, message="x"):
    return SimpleNamespace(exitcode=code, message=message)


def test_the_reported_failure_is_rank_0s_known_one_else_the_lowest_known():
    assert failures.chosen_failure({0: _failure(3, "stopped"), 1: _failure(-15)}) == (3, "stopped")
    assert failures.chosen_failure({0: _failure(-15), 1: _failure(4, "ck")}) == (4, "ck")
    assert failures.chosen_failure({0: _failure(1), 1: _failure(-15)}) is None  # a crash: its traceback


def test_tyro_errors_become_one_line_naming_the_flag(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(DEBUG_TOML, ["--training.stepz", "4"])
    assert str(e.value).startswith("unknown flag '--training.stepz'; allowed keys in [training]: ")
    with pytest.raises(ConfigError, match=r"^command line: --training.steps: invalid literal for int"):
        load_config(DEBUG_TOML, ["--training.steps", "x"])
    with pytest.raises(ConfigError, match=r"^profiling.flop_table_depth = 0: expected an int >= 1$"):
        load_config(DEBUG_TOML, ["--profiling.flop_table_depth", "0"])
    assert tyro_message("garbage") == "command line: garbage"


@pytest.mark.parametrize(
    "content, message",
    [(b"\xff\xfe\x00binary", "not a text file"), (b"# only a comment\n", "empty (no keys)")],
)
def test_binary_and_empty_files(tmp_path, content, message):
    path = tmp_path / "x.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        read_toml(path)
    assert str(e.value).startswith(f"CONFIG_FILE = '{path}': {message}")
    with pytest.raises(ConfigError, match="a folder, expected a TOML file"):
        read_toml(tmp_path)


def test_nonfinite_stop_on_two_ranks_is_one_line_and_exit_code_3(tmp_path):
    # e5m2 without saturation and 2^-30 headroom on one layer's forward input overflows at step 1.
    rule = {"layers": ["layers.1.feed_forward.w2"], "roles": ["forward.input"], "format": "e5m2",
            "scaling": "tensor", "saturate": False, "margin": -30}  # fmt: skip
    cfg = write_toml(
        tmp_path / "nan.toml", quantize={"recipe": "mxfp8", "rules": [rule]}, numerics={"nonfinite": "stop"}
    )
    run = train(tmp_path, "--training.steps", "3", "--checkpoint.no-enable", config=cfg, nproc=2, check=False)
    assert run.returncode == 3, run.log[-3000:]
    assert run.log.strip().splitlines()[-1] == (
        "low-bits-training: stopped: non-finite value (NaN/Inf) first seen at step 1, "
        "module layers.1.feed_forward.w2, role forward.output, rank 0"
    )
    assert "Traceback" not in run.log and "ChildFailedError" not in run.log
