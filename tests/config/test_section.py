"""The one mechanism behind our sections: typed fields, Literal choices and bounds, checked when a section is
built, when the TOML sets it and when a command-line flag rebuilds it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import pytest

from low_bits_training.config.section import AtLeast, Matches, Section
from low_bits_training.config.tree import ConfigError, apply_dict


@dataclass(kw_only=True, slots=True)
class Demo(Section):
    SECTION: ClassVar[str] = "demo"

    freq: Annotated[int, AtLeast(0, "0: off")] = 0
    mode: Literal["warn", "stop"] = "warn"
    name: Annotated[str, Matches(r"[a-z]*", "lower-case letters")] = ""


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"freq": -1}, "demo.freq = -1: expected an int >= 0 (0: off)"),
        ({"freq": 1.5}, "demo.freq = 1.5 (float): expected int"),
        ({"freq": True}, "demo.freq = True (bool): expected int"),
        ({"mode": "halt"}, "demo.mode = 'halt' (str): expected one of 'warn', 'stop'"),
        ({"name": "A/b"}, "demo.name = 'A/b': expected lower-case letters"),
    ],
)
def test_checked_at_construction(kwargs, message):
    with pytest.raises(ConfigError) as e:
        Demo(**kwargs)
    assert str(e.value) == message


def test_checked_when_the_toml_sets_fields_of_an_existing_section():
    d = Demo()
    apply_dict(d, {"freq": 5, "mode": "stop"}, "demo")
    assert (d.freq, d.mode) == (5, "stop")
    with pytest.raises(ConfigError, match=r"^demo.freq = -2: expected an int >= 0 \(0: off\)$"):
        apply_dict(d, {"freq": -2}, "demo")


def test_job_section():
    from low_bits_training.titan.job import JobConfig

    assert JobConfig(base="low_bits_training.titan.bases:llama3_1b", name="run-1.a").name == "run-1.a"
    with pytest.raises(ConfigError, match=r"^job.base = 'llama3': expected 'module:function'"):
        JobConfig(base="llama3")
    with pytest.raises(ConfigError, match=r"^job.name = 'a/b': expected letters, digits"):
        JobConfig(name="a/b")
