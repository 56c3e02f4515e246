"""Bad input is refused in one line, before anything is built or written.

Property-based: random and malformed configuration through the launcher's whole check (``build_config`` then
``validate.check_run``) is a ConfigError with a one-line message, never another exception (a traceback).
Through ``./run_llama_train.sh``: each bad input of issue 15 ends with exactly one line on stderr, the
documented exit code (2 config, 4 checkpoint) and the run folder byte-identical to before."""

import hashlib
import os
import shutil
import string
import subprocess
import tomllib
from pathlib import Path

import pytest
import tomli_w
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import DEBUG_TOML, REPO, train, train_command, train_env, write_toml
from low_bits_training.errors import ConfigError
from low_bits_training.titan.launch.validate import check_run
from low_bits_training.titan.launch.worker import build_config

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
        check_run(build_config(argv), world_size=1)
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


# --- through the launcher, as a user runs it ----------------------------------------------------------------

RUN = ("--training.steps", "2", "--checkpoint.interval", "2")


@pytest.fixture(scope="module")
def previous_run(tmp_path_factory):
    """A finished run folder (resolved config, metrics, a checkpoint at step 2) that bad input must not touch."""
    return train(tmp_path_factory.mktemp("prev"), *RUN).folder


def snapshot(folder: Path) -> dict[str, str]:
    """Every file and folder under ``folder`` with the sha256 of its bytes."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(folder.rglob("*"))
    }


def _launch(
    folder: Path, *args: str, config: Path | None = None, nproc: int = 1
) -> subprocess.CompletedProcess:
    return subprocess.run(
        train_command(folder, *args),
        cwd=REPO,
        env=train_env(nproc, config=config),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _refused(tmp_path, previous_run, *args, code=2, expect="", config=None, nproc=1, damage=None) -> str:
    folder = tmp_path / "run"
    shutil.copytree(previous_run, folder)
    if damage is not None:
        damage(folder)
    before = snapshot(folder)
    p = _launch(folder, *args, config=config, nproc=nproc)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == code, p.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("low-bits-training: "), p.stderr[-3000:]
    assert expect in lines[0], lines[0]
    assert "Traceback" not in p.stdout + p.stderr and p.stdout == ""
    assert snapshot(folder) == before  # nothing written, nothing replaced: the folder still reruns its run
    return lines[0]


def _toml(tmp_path, **sections) -> Path:
    return write_toml(tmp_path / "bad.toml", **sections)


@pytest.mark.parametrize(
    "case, expect",
    [
        ({"training": {"stepz": 4}}, "unknown key 'training.stepz' in [training]; allowed keys:"),
        ({"training": {"steps": -3}}, "training.steps = -3: expected an int >= 1"),
        ({"quantize": {"rules": [{"format": "e9m9"}]}}, "e9m9"),
        ({"profiling": {"flop_table_step": -1}}, "profiling.flop_table_step = -1: expected an int >= 0"),
    ],
    ids=["key-typo", "negative-steps", "unknown-format", "profiling-range"],
)
def test_bad_toml_through_the_launcher(tmp_path, previous_run, case, expect):
    _refused(tmp_path, previous_run, config=_toml(tmp_path, **case), expect=expect)


def test_negative_learning_rate_is_refused(tmp_path, previous_run):
    groups = tomllib.loads(DEBUG_TOML.read_text())["optimizer"]["param_groups"]
    groups[0]["optimizer_kwargs"]["lr"] = -3e-3
    _refused(
        tmp_path,
        previous_run,
        config=_toml(tmp_path, optimizer={"param_groups": groups}),
        expect="optimizer.param_groups[0].optimizer_kwargs.lr = -0.003: expected a number >= 0",
    )


@pytest.mark.parametrize(
    "content, expect",
    [(b"\x00\x9f\xffPK\x03\x04binary", "not a text file"), (b"", "empty (no keys)")],
    ids=["binary", "empty"],
)
def test_binary_and_empty_toml(tmp_path, previous_run, content, expect):
    path = tmp_path / "x.toml"
    path.write_bytes(content)
    _refused(tmp_path, previous_run, config=path, expect=f"CONFIG_FILE = '{path}': {expect}")


@pytest.mark.parametrize(
    "args, expect",
    [
        (("--training.stepz", "4"), "unknown flag '--training.stepz'; allowed keys in [training]:"),
        (("--training.steps", "abc"), "--training.steps: invalid literal for int()"),
        (("--training.local_batch_size", "0"), "training.local_batch_size = 0: expected an int >= 1"),
        (
            ("--memory.limit_gib", "-1"),
            "memory.limit_gib = -1.0: expected a number >= 0 (0: the device's free",
        ),
    ],
    ids=["flag-typo", "flag-type", "zero-batch", "memory-limit"],
)
def test_bad_flags(tmp_path, previous_run, args, expect):
    _refused(tmp_path, previous_run, *args, expect=expect)


def test_a_run_planned_over_the_memory_limit_is_refused_before_any_rank(tmp_path, previous_run):
    # titan/runtime/peak.py plans 0.41 GiB for this batch (0.22 with selective AC, which fits 0.92 x 0.25 GiB);
    # the previous run's shape (seq_len) is kept: its checkpoint would refuse another one first
    line = _refused(
        tmp_path,
        previous_run,
        *("--training.local_batch_size", "32", "--memory.limit_gib", "0.25"),
        expect="memory: rank 0 would peak at 0.41 GiB",
    )
    assert (
        "over 0.92 x 0.25 GiB (memory.limit_gib = 0.25); --activation_checkpoint selective plans 0.22 GiB"
        in line
    )


def test_degrees_that_do_not_fit_the_processes(tmp_path, previous_run):
    _refused(
        tmp_path,
        previous_run,
        "--parallelism.data_parallel_shard_degree", "2",
        nproc=3,
        expect="parallelism.data_parallel_shard_degree = 2: with the other degrees at 1 the degrees multiply "
        "to 2, but NGPU x nodes = 3 processes",
    )  # fmt: skip


def _truncate_largest(folder: Path) -> None:
    victim = max((folder / "checkpoint" / "step-2").glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)


@pytest.mark.parametrize(
    "args, damage, nproc, expect",
    [
        ((), _truncate_largest, 1, "step-2 is damaged: "),
        (
            ("--quantize.recipe", "fp8_rowwise"),
            None,
            1,
            "(quantize.recipe: checkpoint has 'bf16', this run has",
        ),
        (
            ("--job.base", "low_bits_training.titan.launch.bases:llama3_tiny"),
            None,
            1,
            "(model.config.layers:",
        ),
        ((), None, 2, "holds the data position of 1 data-parallel rank(s), this run has 2"),
    ],
    ids=["truncated", "another-plan", "another-model", "resharded-data"],
)
def test_checkpoints_that_cannot_be_resumed(tmp_path, previous_run, args, damage, nproc, expect):
    line = _refused(tmp_path, previous_run, *RUN, *args, code=4, damage=damage, nproc=nproc, expect=expect)
    assert line.startswith("low-bits-training: checkpoint refused: checkpoint ")


# --- [quantize.comm]: low-bit collectives need FSDP2's (docs/communication.md) --------------------------------

FP8_WIRE = {"format": "e4m3", "scaling": "tensor"}
COMM_CASES = [
    (
        {"all_gather": FP8_WIRE},
        1,
        (),
        "quantize.comm.all_gather.format = 'e4m3': parallelism.data_parallel_shard_degree = 1, so FSDP2 shards "
        "nothing",
    ),
    (
        {"reduce_scatter": FP8_WIRE},
        2,
        ("--parallelism.tensor_parallel_degree", "2"),
        "quantize.comm: tensor_parallel_degree = 2, expert_parallel_degree = 1: low-bit collectives are FSDP2's",
    ),
    (
        {"reduce_scatter": FP8_WIRE},
        2,
        ("--parallelism.data_parallel_replicate_degree", "2"),
        "quantize.comm.reduce_scatter: data_parallel_replicate_degree = 2: FSDP2 all-reduces replicated",
    ),
    ({"reduce_scatter": {"format": "e9m9"}}, 2, (), "quantize.comm.reduce_scatter: unknown format 'e9m9'"),
    ({"all_gather": {"format": "e4m3", "scaling": "diagonal"}}, 2, (), "quantize.comm.all_gather.scaling = 'diagonal'"),
]  # fmt: skip
COMM_IDS = ["no-sharding", "tensor-parallel", "replicated-grads", "unknown-format", "bad-scaling"]


@pytest.mark.parametrize("comm, nproc, args, expect", COMM_CASES, ids=COMM_IDS)
def test_comm_formats_without_their_collective_are_refused(tmp, comm, nproc, args, expect):
    path = write_toml(tmp / "comm.toml", quantize={"recipe": "bf16", "comm": comm})
    with pytest.raises(ConfigError) as e:
        check_run(build_config(["--config-file", str(path), *args]), world_size=nproc)
    assert str(e.value).startswith(expect) and "\n" not in str(e.value), str(e.value)


def test_comm_formats_on_one_rank_through_the_launcher(tmp_path, previous_run):
    comm, nproc, args, expect = COMM_CASES[0]
    cfg = _toml(tmp_path, quantize={"recipe": "bf16", "comm": comm})
    _refused(tmp_path, previous_run, *RUN, *args, config=cfg, nproc=nproc, expect=expect)
