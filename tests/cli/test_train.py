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
    assert scripts["lbt-train"] == "low_bits_training.cli.train:main" and train.main is launcher.main
    assert "low_bits_training.titan.launch.launcher" in (REPO / "run_llama_train.sh").read_text()


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
