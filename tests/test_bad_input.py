"""Property-based: random and malformed configuration is refused with one line (a ConfigError), never with
another exception (a traceback), before anything is built."""

import os
import string
import tomllib

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import DEBUG_TOML
from low_bits_training.config.tree import ConfigError
from low_bits_training.titan.launch import build_config

BASE = tomllib.loads(DEBUG_TOML.read_text())
SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)

names = st.text(string.ascii_lowercase + "_", min_size=1, max_size=12)
scalars = st.one_of(
    st.text(max_size=8), st.integers(-(2**40), 2**40), st.floats(allow_nan=False), st.booleans()
)
values = st.one_of(scalars, st.lists(scalars, max_size=3), st.dictionaries(names, scalars, max_size=2))
KNOWN = [(s, k) for s, sec in BASE.items() if isinstance(sec, dict) for k in sec if s != "optimizer"]
QUANT_KEYS = ["format", "scaling", "block_size", "scale_format", "scale_rounding", "rounding", "saturate"]


def _check(tmp_path, data: dict) -> None:
    path = tmp_path / "x.toml"
    path.write_text(tomli_w.dumps(data))
    _refused_in_one_line_or_valid(["--config-file", str(path)])


def _refused_in_one_line_or_valid(argv: list[str]) -> None:
    try:
        build_config(argv)
    except ConfigError as e:
        assert str(e) and "\n" not in str(e), repr(str(e))
    # any other exception propagates and fails the test: the user would see a traceback


def _with(section: str, key: str, value) -> dict:
    data = {s: (dict(v) if isinstance(v, dict) else v) for s, v in BASE.items()}
    data.setdefault(section, {})[key] = value
    return data


@pytest.fixture(scope="module", autouse=True)
def _cwd(tmp_path_factory):
    # Relative paths a random config names (a dataset folder to build) land in a scratch folder, not the repo.
    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(old)


@pytest.fixture
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("bad")


@SETTINGS
@given(key=st.sampled_from(KNOWN), value=values)
def test_wrong_types_for_known_keys(tmp, key, value):
    _check(tmp, _with(*key, value))


@SETTINGS
@given(section=st.one_of(st.sampled_from([s for s, _ in KNOWN]), names), key=names, value=scalars)
def test_unknown_keys_and_sections(tmp, section, key, value):
    _check(tmp, _with(section, key, value))


@SETTINGS
@given(recipe=st.one_of(st.text(max_size=10), st.sampled_from(["fp8", "mxfp9", "e9m9", "int3", "nvfp4x"])))
def test_unknown_recipes(tmp, recipe):
    _check(tmp, _with("quantize", "recipe", recipe))


@SETTINGS
@given(
    rule=st.dictionaries(
        st.sampled_from(QUANT_KEYS + ["layers", "roles", "first_n", "bogus"]),
        st.one_of(
            scalars, st.sampled_from(["e4m3", "block", "tile", "e8m0", "e2m1", "xyz"]), st.integers(0, 300)
        ),
        min_size=1,
        max_size=4,
    )
)
def test_impossible_and_malformed_plans(tmp, rule):
    _check(tmp, _with("quantize", "rules", [rule]))


@SETTINGS
@given(text=st.text(max_size=60))
def test_malformed_toml_text(tmp, text):
    path = tmp / "x.toml"
    path.write_text(text)
    _refused_in_one_line_or_valid(["--config-file", str(path)])


def test_a_block_size_that_does_not_divide_is_refused_naming_it(tmp):
    rule = {"layers": ["*"], "roles": ["*"], "format": "e4m3", "scaling": "block", "block_size": 48}
    with pytest.raises(ConfigError, match="48") as e:
        build_config(["--config-file", str(_write(tmp, _with("quantize", "rules", [rule])))])
    assert "\n" not in str(e.value)


def _write(tmp, data):
    path = tmp / "y.toml"
    path.write_text(tomli_w.dumps(data))
    return path
