"""QuantSpec's fields reach the sections that set them: every one a ``[[quantize.rules]]`` field (but
``format`` and ``axis``), each with no choice QuantSpec refuses, in rules, wire formats and saved formats alike,
and ``plan.resolve`` / ``wire_spec`` / ``rule_format`` pass each one on by name (``formats.spec.spec_kwargs``).
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Annotated, Literal, Union, get_args, get_origin, get_type_hints

import pytest

from low_bits_training.config import quantize
from low_bits_training.config.comm import WireFormat, wire_spec
from low_bits_training.config.quantize import RULE_SPEC_FIELDS, RULE_UNSET_SPEC_FIELDS, QuantRule
from low_bits_training.config.saved import SavedRule, rule_format
from low_bits_training.config.section import AtLeast
from low_bits_training.formats import QuantSpec
from low_bits_training.formats.spec import shared_spec_fields, spec_kwargs
from low_bits_training.plan.resolve import rule_spec

SECTIONS = (QuantRule, WireFormat, SavedRule)
"""The config sections whose fields named as QuantSpec's set those fields."""


def choices(cls: type) -> dict[str, tuple]:
    """Field name -> its ``Literal`` choices, for each field of dataclass ``cls`` annotated with a Literal
    (under ``Annotated`` and ``X | None`` alike)."""
    hints = get_type_hints(cls, include_extras=True)
    out = {}
    for f in dataclasses.fields(cls):
        t = hints[f.name]
        while get_origin(t) in (Annotated, Union, types.UnionType):
            args = [a for a in get_args(t) if a is not type(None)]
            if get_origin(t) is not Annotated and len(args) != 1:
                break  # a union of several types: not one choice list
            t = args[0]
        if get_origin(t) is Literal:
            out[f.name] = get_args(t)
    return out


def missing_fields(spec: type, rule: type) -> list[str]:
    """The fields of ``spec`` but ``RULE_UNSET_SPEC_FIELDS`` that ``rule`` does not declare."""
    have = {f.name for f in dataclasses.fields(rule)}
    return [
        f.name
        for f in dataclasses.fields(spec)
        if f.name not in RULE_UNSET_SPEC_FIELDS and f.name not in have
    ]


def foreign_choices(spec: type, section: type) -> list[str]:
    """``name: value`` for each Literal choice of a ``section`` field named as a ``spec`` field that the spec's
    own Literal does not accept."""
    ours, theirs = choices(section), choices(spec)
    return [f"{n}: {v}" for n, vs in ours.items() if n in theirs for v in vs if v not in theirs[n]]


def test_quantrule_declares_every_quantspec_field():
    assert missing_fields(QuantSpec, QuantRule) == []
    assert RULE_UNSET_SPEC_FIELDS == ("format", "axis")
    names = [f.name for f in dataclasses.fields(QuantSpec)]
    assert list(RULE_SPEC_FIELDS) == [n for n in names if n not in ("format", "axis")]


@dataclass(frozen=True)
class GrownSpec(QuantSpec):
    underflow: Literal["flush", "keep"] = "keep"
    """A field QuantSpec might gain."""


def test_a_quantspec_field_quantrule_lacks_is_caught(monkeypatch):
    assert missing_fields(GrownSpec, QuantRule) == ["underflow"]
    # The import-time check, as it would run with QuantSpec grown by that field.
    monkeypatch.setattr(quantize, "RULE_SPEC_FIELDS", (*RULE_SPEC_FIELDS, "underflow"))
    with pytest.raises(TypeError, match=r"QuantRule must declare .* missing: \['underflow'\]"):
        quantize._check_rule_fields()


@pytest.mark.parametrize("section", SECTIONS, ids=lambda c: c.__name__)
def test_section_choices_are_quantspecs(section):
    assert shared_spec_fields(section), "a section of no QuantSpec field"
    assert foreign_choices(QuantSpec, section) == []


@dataclass
class Madeup:
    rounding: Annotated[Literal["nearest", "banker"] | None, AtLeast(0)] = None
    scaling: Literal["tensor", "block"] = "tensor"
    mode: Literal["a", "b"] = "a"  # not a QuantSpec field: any choices
    block_size: int | str = 1  # several types: no choice list


def test_a_choice_quantspec_refuses_is_caught():
    assert choices(Madeup) == {
        "rounding": ("nearest", "banker"),
        "scaling": ("tensor", "block"),
        "mode": ("a", "b"),
    }
    assert foreign_choices(QuantSpec, Madeup) == ["rounding: banker"]
    assert foreign_choices(GrownSpec, QuantRule) == []  # QuantRule lacks the field: missing_fields' case


def test_resolve_sets_the_derived_fields():
    assert shared_spec_fields(QuantRule) == RULE_SPEC_FIELDS  # what plan.resolve.rule_spec passes on
    rule = QuantRule()
    for name in RULE_SPEC_FIELDS:
        object.__setattr__(rule, name, f"<{name}>")
    assert list(spec_kwargs(rule)) == list(RULE_SPEC_FIELDS)


NVFP4_4OVER6 = QuantSpec(
    "e2m1", "block", block_size=16, scale_format="ue4m3", rounding="stochastic", saturate=False, margin=1,
    tensor_scale=True, scale_min="normal", inf_amax="nan", four_over_six="mse", rht=16, rht_seed=3, rht_signs="te",
    rht_output="bf16",
    scale_underflow="zero",
    source="forward",
)  # fmt: skip
DELAYED = QuantSpec(
    "e4m3",
    "tensor",
    scale_rounding="floor",
    amax_history=4,
    amax_compute="most_recent",
    scale_apply="reciprocal",
)
NVFP4_TE = QuantSpec.nvfp4(scale_apply="reciprocal", scale_order="te")
"""scale_order "te" holds with neither of the two above (it needs two-level scales and no 4over6)."""
SPECS = (NVFP4_4OVER6, DELAYED, NVFP4_TE)


def test_a_rule_sets_each_field_of_the_spec():
    default = QuantSpec("e4m3")
    unset = [n for n in RULE_SPEC_FIELDS if all(getattr(s, n) == getattr(default, n) for s in SPECS)]
    assert unset == [], "give these fields a value other than the default in a spec of this test"
    for want in SPECS:
        rule = QuantRule(format=want.format, **{n: getattr(want, n) for n in RULE_SPEC_FIELDS})
        assert rule_spec(rule, default, "quantize.rules[0]") == want
        kept = QuantRule(**{n: getattr(want, n) for n in RULE_SPEC_FIELDS})  # format unset: the current one's
        assert rule_spec(kept, QuantSpec(want.format), "quantize.rules[0]") == want


def test_wire_and_saved_formats_pass_each_field_on():
    wire = QuantSpec(
        "e4m3", "block", block_size=64, scale_format="e8m0", scale_rounding="floor", rounding="stochastic"
    )
    section = WireFormat(format="e4m3", **{n: getattr(wire, n) for n in shared_spec_fields(WireFormat)})
    assert wire_spec(section, "reduce_scatter") == wire
    saved = dataclasses.replace(wire, rounding="toward_zero", saturate=False)
    rule = SavedRule(format="E4M3", **{n: getattr(saved, n) for n in shared_spec_fields(SavedRule)})
    assert rule_format(rule, "quantize.saved[0]").spec == saved
