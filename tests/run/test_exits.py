"""One table of exit codes (run/exits.py): run_llama_train.sh's documented codes, its own ``exit``, the README's
table and the launcher's errors are all that enum."""

from __future__ import annotations

import re

from helpers import REPO
from low_bits_training.errors import ConfigError
from low_bits_training.run.exits import (
    ENDINGS,
    SIGNAL_BASE,
    CheckpointError,
    ExitCode,
    NonFiniteError,
    classify,
)

SCRIPT = (REPO / "run_llama_train.sh").read_text()
WORDS = {"done": ExitCode.OK, "config": ExitCode.CONFIG, "non-finite": ExitCode.NONFINITE,
         "checkpoint": ExitCode.CHECKPOINT, "crash": ExitCode.CRASH}  # fmt: skip
"""The word run_llama_train.sh's comment gives each code."""


def test_run_llama_train_documents_the_enum():
    comment = " ".join(ln.lstrip("# ") for ln in SCRIPT.splitlines() if ln.startswith("#"))
    listed = re.search(r"Exit codes: (.*?) \(README", comment).group(1)
    said = {int(code): word for code, word in re.findall(r"(\d+) ([a-z-]+)", listed)}
    assert {code: WORDS[word] for code, word in said.items()} == {int(c): c for c in ExitCode}
    assert set(re.findall(r"^\s*exit (\d+)$", SCRIPT, re.M)) == {str(ExitCode.CONFIG.value)}  # bad NGPU


def test_readme_table_is_the_enum():
    readme = (REPO / "README.md").read_text()
    table = readme.split("### Exit codes", 1)[1].split("\n\n", 2)[1]
    codes = [c for c in re.findall(r"^\| (\S+) \|", table, re.M) if c != "code"]  # the header's
    assert codes == ["0", "2", "3", "4", "1", f"{SIGNAL_BASE}+N"]
    assert {int(c) for c in codes[:-1]} == {c.value for c in ExitCode}
    assert "low_bits_training/run/exits.py" in readme.split("### Exit codes", 1)[1].split("##", 1)[0]


def test_every_ending_has_its_own_code_and_a_crash_has_none():
    assert [e.code for e in ENDINGS] == [ExitCode.CONFIG, ExitCode.NONFINITE, ExitCode.CHECKPOINT]
    assert classify(ConfigError("training.steps = -3: expected an int >= 1")) == (
        ExitCode.CONFIG,
        "low-bits-training: config error: training.steps = -3: expected an int >= 1",
    )
    assert classify(NonFiniteError("x"))[0] == 3 and classify(CheckpointError("y"))[0] == 4
    assert classify(RuntimeError("boom")) is None  # a crash: its traceback, ExitCode.CRASH


def test_the_old_homes_are_the_same_classes():
    from low_bits_training.titan.runtime.checkpoint import CheckpointError as titan_checkpoint_error
    from low_bits_training.titan.runtime.numerics import NonFiniteError as titan_nonfinite_error

    assert titan_checkpoint_error is CheckpointError and titan_nonfinite_error is NonFiniteError
