"""[numerics] in real torchtitan training on CPU: the "stop" policy names step / module / role / rank."""

from __future__ import annotations

from helpers import train, write_toml

# e5m2 without saturation and 2^-30 headroom on one layer's forward input: x / scale overflows to inf inside
# that layer's forward GEMM at step 1.
OVERFLOW_RULE = {
    "layers": ["layers.1.feed_forward.w2"],
    "roles": ["forward.input"],
    "format": "e5m2",
    "scaling": "tensor",
    "saturate": False,
    "margin": -30,
}


def test_stop_policy_names_the_first_nonfinite_and_exits_nonzero(tmp_path):
    cfg = write_toml(
        tmp_path / "nan.toml",
        quantize={"recipe": "mxfp8", "rules": [OVERFLOW_RULE]},
        numerics={"nonfinite": "stop"},
    )
    # compiled: the non-finite flags are in-graph probes, read once per step (nn/probe.py)
    run = train(
        tmp_path,
        "--training.steps",
        "3",
        "--checkpoint.no-enable",
        "--compile.enable",
        config=cfg,
        check=False,
    )
    assert run.returncode == 3, run.log[-3000:]  # the launcher's documented exit code for a non-finite stop
    line = (
        "low-bits-training: stopped: non-finite value (NaN/Inf) first seen at step 1, "
        "module layers.1.feed_forward.w2, role forward.output, rank 0"
    )
    assert line in run.log, run.log[-3000:]
    assert "Traceback" not in run.log, run.log[-3000:]
