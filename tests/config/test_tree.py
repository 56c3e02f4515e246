"""The generic TOML -> dataclass layer: types, unknown keys, named choices, lists of tables, diff round trip."""

from dataclasses import dataclass, field
from typing import Annotated, Literal

import pytest

from low_bits_training.config.tree import apply_dict, build_dataclass, diff
from low_bits_training.errors import ConfigError


class _Choice:
    def __init__(self, name):
        self.name = name


@dataclass
class Inner:
    steps: int = 10
    lr: float = 1e-3
    mode: Literal["a", "b"] = "a"
    tags: list[str] = field(default_factory=list)
    size: tuple[int, int] = (1, 2)
    maybe: int | None = None


@dataclass
class Item:
    pattern: str
    kwargs: dict = field(default_factory=dict)


@dataclass
class Full:
    keep: bool = True


@dataclass
class Root:
    inner: Inner = field(default_factory=Inner)
    items: list[Item] = field(default_factory=list)
    ac: Annotated[Full, _Choice("full")] | Annotated[None, _Choice("none")] = field(default_factory=Full)
    name: str = "x"


def test_values_are_set_and_coerced():
    r = Root()
    apply_dict(r, {"inner": {"steps": 4, "lr": 1, "mode": "b", "tags": ["p"], "size": [3, 4], "maybe": 7}})
    assert (r.inner.steps, r.inner.lr, r.inner.mode, r.inner.tags, r.inner.size, r.inner.maybe) == (
        4,
        1.0,
        "b",
        ["p"],
        (3, 4),
        7,
    )
    assert isinstance(r.inner.lr, float) and isinstance(r.inner.size, tuple)


@pytest.mark.parametrize(
    "data, message",
    [
        (
            {"inner": {"stepz": 1}},
            "unknown key 'inner.stepz' in [inner]; allowed keys: lr, maybe, mode, size, steps, tags",
        ),
        ({"nope": 1}, "unknown key 'nope' in the top level; allowed keys: ac, inner, items, name"),
        ({"inner": {"steps": "ten"}}, "inner.steps = 'ten' (str): expected int"),
        ({"inner": {"steps": True}}, "inner.steps = True (bool): expected int"),
        ({"inner": {"steps": 1.5}}, "inner.steps = 1.5 (float): expected int"),
        ({"inner": {"mode": "c"}}, "inner.mode = 'c': expected one of a, b"),
        ({"inner": {"size": [1, 2, 3]}}, "inner.size = [1, 2, 3] (list): expected tuple[int, int]"),
        ({"inner": {"tags": [1]}}, "inner.tags = [1] (list): expected list[str]"),
        ({"items": [{"kwargs": {}}]}, "items[0]: missing required key 'pattern' (Item)"),
        (
            {"items": [{"pattern": ".*", "bad": 1}]},
            "unknown key 'items[0].bad'; allowed keys: kwargs, pattern",
        ),
        ({"ac": "partial"}, "ac = 'partial': expected one of 'full', 'none'"),
        ({"ac": {"kind": "none", "keep": True}}, "ac: choice 'none' takes no keys, got keep"),
        ({"name": 3}, "name = 3 (int): expected str"),
        ({"inner": {"lr": []}}, "inner.lr = [] (list): expected float"),  # found by tests/test_bad_input.py
        ({"inner": {"lr": ""}}, "inner.lr = '' (str): expected float"),
    ],
)
def test_every_error_is_one_line_naming_key_value_and_allowed(data, message):
    with pytest.raises(ConfigError) as e:
        apply_dict(Root(), data)
    assert str(e.value) == message
    assert "\n" not in str(e.value)


def test_named_choices_and_lists_of_tables():
    r = Root()
    apply_dict(r, {"ac": "none", "items": [{"pattern": "a"}, {"pattern": "b", "kwargs": {"lr": 1}}]})
    assert r.ac is None and [i.pattern for i in r.items] == ["a", "b"] and r.items[1].kwargs == {"lr": 1}
    apply_dict(r, {"ac": {"kind": "full", "keep": False}})
    assert r.ac == Full(keep=False)


def test_build_dataclass_reports_the_class_refusal():
    @dataclass
    class Checked:
        n: int = 1

        def __post_init__(self):
            if self.n < 0:
                raise ValueError("n must be >= 0\nmore detail")

    with pytest.raises(ConfigError, match=r"^x: n must be >= 0$"):
        build_dataclass(Checked, {"n": -1}, "x")


def test_diff_reads_back_to_the_same_tree():
    new = Root()
    apply_dict(new, {"inner": {"steps": 3, "size": [5, 6]}, "ac": "none", "items": [{"pattern": "p"}]})
    d = diff(new, Root())
    assert d == {
        "inner": {"steps": 3, "size": [5, 6]},
        "ac": "none",
        "items": [{"pattern": "p", "kwargs": {}}],
    }
    again = Root()
    apply_dict(again, d)
    assert again == new
