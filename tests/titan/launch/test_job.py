"""``[job]``: one class (config/job.py) for the TOML loader and the trainer's tree; ``--job.name`` on the command
line is checked and names the run folder as the TOML's ``name`` does, through the launcher's own check."""

from __future__ import annotations

import dataclasses

import pytest

from helpers import DEBUG_TOML, write_toml
from low_bits_training.config.job import JobConfig
from low_bits_training.run.exits import ExitCode
from low_bits_training.titan.launch import launcher
from low_bits_training.titan.runtime.trainer import LowBitsTrainer


@pytest.fixture(autouse=True)
def _elsewhere(monkeypatch, tmp_path):
    # Relative run folders and assets resolve against the working directory, as under run_llama_train.sh:
    # here a fresh one, never the checkout (whose outputs/ may hold the README's first run, issue 41).
    monkeypatch.chdir(tmp_path)


def _folder(*args: str, config=DEBUG_TOML) -> str:
    config_tree, _ = launcher.check(["--config-file", str(config), *args], 1)
    return config_tree.dump_folder


def test_one_job_class():
    (job,) = [f for f in dataclasses.fields(LowBitsTrainer.Config) if f.name == "job"]
    assert job.default_factory is JobConfig


def test_job_name_sets_the_run_folder_from_the_toml_or_the_command_line(tmp_path):
    assert _folder() == "outputs/debug_model"  # the preset's [job] name
    assert _folder("--job.name", "x") == "outputs/x"  # the command line wins, as for every key
    assert _folder("--job.name=y.1") == "outputs/y.1"
    given = str(tmp_path / "here")
    assert _folder("--job.name", "x", "--dump_folder", given) == given  # a dump_folder given wins
    in_toml = write_toml(tmp_path / "c.toml", dump_folder=given)
    assert _folder("--job.name", "x", config=in_toml) == given


@pytest.mark.parametrize(
    "flag, line",
    [
        (("--job.name", "a/b"), "job.name = 'a/b': expected letters, digits, '.', '_' and '-' (it names a folder)"),
        (("--job.base", "llama3"), "job.base = 'llama3': expected 'module:function', e.g. 'llama3:llama3_debugmodel'"),
    ],
)  # fmt: skip
def test_a_bad_job_flag_is_one_line_and_exit_2(capsys, flag, line):
    code = launcher.main([launcher.CHECK_ONLY, "--", "--config-file", str(DEBUG_TOML), *flag])
    assert code == ExitCode.CONFIG
    assert capsys.readouterr().err.splitlines() == [f"low-bits-training: config error: {line}"]
