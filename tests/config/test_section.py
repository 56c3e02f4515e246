"""The one mechanism behind our sections: typed fields, Literal choices and bounds, checked when a section is
built, when the TOML sets it and when a command-line flag rebuilds it; and the sections built on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import pytest

from low_bits_training.config.numerics import NumericsConfig
from low_bits_training.config.quantize import Phase, PlanChange, QuantizeConfig, QuantRule
from low_bits_training.config.section import AtLeast, Matches, Section
from low_bits_training.config.tree import apply_dict, build_dataclass
from low_bits_training.errors import ConfigError


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
        ({"mode": "halt"}, "demo.mode = 'halt': expected one of warn, stop"),
        ({"mode": 3}, "demo.mode = 3 (int): expected one of warn, stop"),
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
    from low_bits_training.config.job import JobConfig

    assert JobConfig(base="low_bits_training.titan.launch.bases:llama3_1b", name="run-1.a").name == "run-1.a"
    with pytest.raises(ConfigError, match=r"^job.base = 'llama3': expected 'module:function'"):
        JobConfig(base="llama3")
    with pytest.raises(ConfigError, match=r"^job.name = 'a/b': expected letters, digits"):
        JobConfig(name="a/b")


# --- the sections built on it: [quantize] (rules, phases, eval) and [numerics] ------------------------------


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda: QuantizeConfig(recipe="none"),
            "quantize.recipe = 'none': expected one of bf16, fp8_tensorwise, fp8_rowwise,",
        ),
        (
            lambda: QuantizeConfig(backend="real"),
            "quantize.backend = 'real': expected one of emulate, torchao, auto (the hand-written _scaled_mm "
            "backend is a Python-only reference now; real kernels come from torchao)",
        ),
        (lambda: QuantizeConfig(skip="lm_head"), "quantize.skip = 'lm_head' (str): expected list[str]"),
        (lambda: QuantRule(scaling="rows"), "quantize.rules.scaling = 'rows': expected one of none, tensor,"),
        (lambda: QuantRule(block_size=0), "quantize.rules.block_size = 0: expected an int >= 1"),
        (lambda: QuantRule(last_n=-1), "quantize.rules.last_n = -1: expected an int >= 0"),
        (lambda: Phase(start=3, recipe="fp3"), "quantize.phases.recipe = 'fp3': expected one of bf16,"),
        (lambda: PlanChange(recipe="fp3"), "quantize.eval.recipe = 'fp3': expected one of bf16,"),
        (lambda: NumericsConfig(nonfinite="halt"), "numerics.nonfinite = 'halt': expected one of off, warn,"),
        (lambda: NumericsConfig(stats_freq=-1), "numerics.stats_freq = -1: expected an int >= 0 (0: off)"),
    ],
)
def test_sections_refuse_at_construction(make, message):
    with pytest.raises(ConfigError) as e:
        make()
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_nested_values_are_refused_under_their_own_key():
    # From TOML: the index of the rule / phase is in the key.
    with pytest.raises(ConfigError, match=r"^quantize.rules\[1\].rounding = 'up': expected one of nearest,"):
        build_dataclass(QuantizeConfig, {"rules": [{}, {"rounding": "up"}]}, "quantize")
    with pytest.raises(
        ConfigError, match=r"^quantize.phases\[0\].rules\[0\].rht = -2: expected an int >= 0$"
    ):
        build_dataclass(QuantizeConfig, {"phases": [{"start": 5, "rules": [{"rht": -2}]}]}, "quantize")
    q = QuantizeConfig()
    with pytest.raises(ConfigError, match=r"^quantize.eval.recipe = 'fp3': expected one of bf16,"):
        apply_dict(q, {"eval": {"recipe": "fp3"}}, "quantize")
    # A section built in Python checks what it holds, each under its index.
    bad = QuantRule()
    object.__setattr__(bad, "scale_format", "fp64")
    with pytest.raises(
        ConfigError, match=r"^quantize.rules\[0\].scale_format = 'fp64': expected one of fp32,"
    ):
        QuantizeConfig(rules=[bad])


def test_recipe_names_are_the_table_keys():
    from typing import get_args

    from low_bits_training.nn.recipes import RECIPES, RecipeName

    assert get_args(RecipeName) == tuple(RECIPES)
    assert QuantizeConfig(recipe="nvfp4", rules=[QuantRule(scaling="tile", block_size=16)]).recipe == "nvfp4"
