"""The rule that marks tests slow (tests/tiers.py), held to small examples: what it must find (directly, through
a helper of the test folder, under another name, in a fixture) and what it must let pass. None of the
example functions is run."""

import re
import subprocess

import pytest
import torch
from tiers import slow_reason

from helpers import train as train_under_another_name
from low_bits_training.optim import LowBitAdamW


def _trains(tmp_path):
    train_under_another_name(tmp_path, "--training.steps", "2")


def _starts_a_process():
    subprocess.run(["true"], check=True)


def _compiles(f):
    return torch.compile(f)(torch.ones(2))


def _through_a_helper(tmp_path):
    return _trains(tmp_path)


def _imports_its_own():
    import subprocess as sp

    sp.check_output(["true"])


def _nested():
    def inner(f):
        return torch.compile(f, backend="aot_eager")

    return inner


def _compiles_a_module(blocks):
    for block in blocks:
        block.compile(fullgraph=True)


def _fused_optimizer(ps):
    return LowBitAdamW(ps, fused=True)


def _eager_optimizer(ps):
    return LowBitAdamW(ps, fused=False)


def _other_compile():
    return re.compile("x+").match("xx")


def _plain():
    return torch.ones(3).sum()


@pytest.mark.parametrize(
    "fn, why",
    [
        (_trains, "trains through the launcher (helpers.train) in _trains"),
        (_starts_a_process, "starts a process (subprocess) in _starts_a_process"),
        (_compiles, "compiles (torch.compile) in _compiles"),
        (_through_a_helper, "trains through the launcher (helpers.train) in _trains"),
        (_imports_its_own, "starts a process (subprocess) in _imports_its_own"),
        (_nested, "compiles (torch.compile) in _nested"),
        (_compiles_a_module, "compiles (a module's .compile()) in _compiles_a_module"),
        (_fused_optimizer, "compiles (an optimizer with fused=True) in _fused_optimizer"),
    ],
)
def test_slow_calls_are_found(fn, why):
    assert slow_reason([fn]) == why


@pytest.mark.parametrize("fn", [_eager_optimizer, _other_compile, _plain, torch.compile, subprocess.run])
def test_everything_else_is_fast(fn):
    # The last two: a library's function is not read, only the test folder's (a test *calling* them is slow).
    assert slow_reason([fn]) is None


def test_a_fused_parameter_compiles():
    assert slow_reason([_plain], params={"fused": True}) == "compiles (parametrized with fused=True)"
    assert slow_reason([_plain], params={"fused": False}) is None


def test_a_fixture_makes_its_tests_slow():
    assert slow_reason([_plain, _trains]) == "trains through the launcher (helpers.train) in _trains"


def test_this_session_marked_by_the_rule(request):
    """The collection hook applied the rule: this file's tests are fast, the smoke run is slow and smoke."""
    marks = {item.nodeid: {m.name for m in item.iter_markers()} for item in request.session.items}
    here = [n for n in marks if n.startswith("tests/test_tiers.py::")]
    assert here and all("slow" not in marks[n] for n in here)
    smoke = "tests/test_smoke.py::test_the_launcher_trains_the_debug_model"
    if smoke in marks:  # selected in this session
        assert {"slow", "smoke"} <= marks[smoke]
