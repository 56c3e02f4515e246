"""``lbt-train`` (pyproject ``[project.scripts]``) is the launcher ``run_llama_train.sh`` runs: the config is
checked before any rank starts, as there (issue 25)."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from helpers import REPO


def test_lbt_train_is_the_launcher():
    from low_bits_training.cli import train
    from low_bits_training.titan.launch import launcher

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["lbt-train"] == "low_bits_training.cli.train:main"
    for script in ("run_llama_train.sh", "scripts/slurm/train.sbatch"):
        assert "-m low_bits_training.cli.train" in (REPO / script).read_text()
    assert train.launcher is launcher  # lbt-train is the launcher, with the speed notes (below)


def test_before_a_gpu_run_one_line_says_what_is_emulated_and_the_step_predicted(
    monkeypatch, capsys, tmp_path
):
    from low_bits_training.cli import speed, train
    from low_bits_training.nn import hardware

    out = str(tmp_path / "run")  # not the checkout's outputs/debug_model (the README's first command's)
    debug = ["--check-only", "--", "--config-file", "train_configs/debug_model.toml", "--dump_folder", out]
    debug.append("--quantize.recipe")
    monkeypatch.chdir(REPO)

    def speed_lines() -> list[
        str
    ]:  # the launcher's notes but its planned peak (tests/titan/runtime/test_peak.py)
        lines = capsys.readouterr().err.splitlines()
        assert lines[0].startswith("low-bits-training: memory: 0.2") and "GiB on rank 0" in lines[0]
        return lines[1:]

    assert train.main([*debug, "deepseek_fp8"]) == 0  # this CPU: no line
    assert speed_lines() == []
    monkeypatch.setattr(speed, "detect_hardware", lambda: hardware.Hardware("cuda", (9, 0)))  # as on an H100
    assert train.main([*debug, "deepseek_fp8"]) == 0
    assert speed_lines() == [
        "low-bits-training: this package on H100: 100% of the quantized GEMM FLOPs emulated, 84% of the GEMM "
        "FLOPs in fp32 on CUDA cores: predicted step 0.31x bf16's (the kernels' figure: 0.62x); lbt-speed "
        "--layers names the GEMMs"
    ]
    assert train.main([*debug, "bf16"]) == 0  # nothing emulated: no line
    assert speed_lines() == []


def test_lbt_train_refuses_a_bad_key_in_one_line_and_writes_nothing(tmp_path):
    # What the console script runs (pip's wrapper: sys.exit(main())), in a fresh process.
    script = "import sys; from low_bits_training.cli.train import main; sys.exit(main())"
    out = tmp_path / "run"
    args = [
        "--config-file",
        "train_configs/debug_model.toml",
        "--dump_folder",
        str(out),
        "--training.stepz",
        "1",
    ]
    p = subprocess.run([sys.executable, "-c", script, *args], cwd=REPO, capture_output=True, text=True)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-3000:]
    assert lines[0].startswith("low-bits-training: config error: ") and "training.stepz" in lines[0]
    assert not out.exists() and p.stdout == ""
