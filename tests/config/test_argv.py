"""The one argv scanner: torchtitan's flag syntax, as every pre-tyro reader (config file, base, redaction)
sees it."""

from low_bits_training.config.argv import flag_names, flag_value, scan, take_flag
from low_bits_training.run.secrets import REDACTED, redact_argv


def test_scan_forms():
    argv = ["pos", "--a.b", "1", "--c.d=x=y", "--e.list", "u", "v", "--f.no-g", "--h", "-3"]
    flags = [(f.name, f.values, f.start, f.end, f.inline) for f in scan(argv)]
    assert flags == [
        ("a.b", ("1",), 1, 3, False),
        ("c.d", ("x=y",), 3, 4, True),
        ("e.list", ("u", "v"), 4, 7, False),
        ("f.no-g", (), 7, 8, False),
        ("h", ("-3",), 8, 10, False),  # a negative number is a value, not a flag
    ]


def test_flag_value_last_wins_and_dashes_match_underscores():
    argv = ["--job.base", "a:b", "--x", "1", "--job.base=c:d"]
    assert flag_value(argv, "job.base") == "c:d"
    assert flag_value(["--quantize.recipe", "mxfp8"], "quantize.recipe") == "mxfp8"
    assert flag_value(["--training.local-batch-size", "4"], "training.local_batch_size") == "4"
    assert flag_value(["--checkpoint.enable"], "checkpoint.enable") is None
    assert flag_names(["--a.no-b", "--c-d.e", "1"]) == ["a.no_b", "c_d.e"]


def test_take_flag_keeps_the_rest_in_order():
    assert take_flag(["--config-file", "x.toml", "--a", "1"], "config-file") == ("x.toml", ["--a", "1"])
    assert take_flag(["--a", "1", "--config-file=y.toml"], "config-file") == ("y.toml", ["--a", "1"])
    assert take_flag(["--a", "1"], "config-file") == (None, ["--a", "1"])


def test_redaction_uses_the_same_reading():
    argv = ["x", "--hf.token", "s1", "--wandb.api_key=s2", "--training.steps", "4", "--my.secret", "a", "b"]
    assert redact_argv(argv) == [
        "x", "--hf.token", REDACTED, f"--wandb.api_key={REDACTED}", "--training.steps", "4",
        "--my.secret", REDACTED, REDACTED,
    ]  # fmt: skip
