"""How ``scripts/ensure_venv.sh`` sets ``.venv`` up (issue 37 item 3): by default the pinned stack from the registry,
torch==2.14.1 included; with ``LBT_TORCH=keep`` around the node's own torch (a build for its driver), which pip
may not replace. The plan (``scripts/keep_torch.py``) is held here in process; the script's dry run, with a
fake node torch (a dist-info folder only), in a subprocess. No venv is made."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from helpers import REPO


def _keep_torch():
    spec = importlib.util.spec_from_file_location("keep_torch", REPO / "scripts" / "keep_torch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


keep = _keep_torch()
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
DEPENDENCIES = PYPROJECT["project"]["dependencies"]
PIN = next(d for d in DEPENDENCIES if d.startswith("torch=="))


def test_the_plan_pins_the_nodes_torch_and_lists_every_other_dependency_once():
    lines = keep.plan(PYPROJECT, None, "2.14.1+cu126", own=False)
    assert lines[0] == "torch==2.14.1+cu126"  # the constraint: pip keeps the installed build
    assert lines[1:] == [d for d in DEPENDENCIES if d != PIN]  # pyproject.toml's list, torch left out
    dev = keep.plan(PYPROJECT, "dev", "2.15.0", own=False)
    assert dev[0] == "torch==2.15.0" and dev[1:] == [
        *lines[1:],
        *PYPROJECT["project"]["optional-dependencies"]["dev"],
    ]


@pytest.mark.parametrize(
    "installed, own, extra, says",
    [
        ("2.13.0+cu121", False, None, "this node's torch is 2.13.0+cu121; allowed: torch >= 2.14.1 (torchtitan 0.3.0"),
        ("2.14.0a0+git1234", False, None, "this node's torch is 2.14.0a0+git1234; allowed: torch >= 2.14.1"),
        (None, False, None, "no torch is installed for "),
        ("2.14.1", True, None, "the venv has a torch of its own (2.14.1), not the node's"),
        ("2.14.1", False, "gpu", "extra 'gpu' is not one of dev"),
    ],
)  # fmt: skip
def test_the_plan_refuses_in_one_line(installed, own, extra, says):
    with pytest.raises(keep.Refused) as e:
        keep.plan(PYPROJECT, extra, installed, own)
    line = str(e.value)
    assert line.startswith(f"{keep.PREFIX}: ") and says in line and "\n" not in line


def test_versions_and_names():
    assert keep.torch_floor(DEPENDENCIES) == PIN.split("==")[1] == "2.14.1"
    assert keep.release("2.14.1+cu126") == (2, 14, 1) and keep.release("2.14.0a0+git") == (2, 14, 0)
    assert keep.name_of("Torch_Foo>=1") == "torch-foo" and keep.name_of("torchtitan==0.3.0") == "torchtitan"


def _dry_run(
    tmp_path: Path,
    torch_version: str | None,
    *extra: str,
    command: tuple = ("bash", "scripts/ensure_venv.sh"),
    **env: str,
) -> subprocess.CompletedProcess:
    """``LBT_SETUP_DRY_RUN=1 bash scripts/ensure_venv.sh`` with ``python3`` a plain interpreter (not a venv) that
    sees a torch ``torch_version`` (a dist-info folder, nothing to import) in its site-packages."""
    site, bin_dir = tmp_path / "site", tmp_path / "bin"
    site.mkdir()
    bin_dir.mkdir()
    if torch_version:
        info = site / f"torch-{torch_version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {torch_version}\n")
    base = getattr(sys, "_base_executable", sys.executable)
    (bin_dir / "python3").write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{base}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", LBT_SETUP_DRY_RUN="1", **env)
    env.pop("PYTHON", None)
    return subprocess.run(
        [*command, *extra],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_default_set_up_is_todays(tmp_path):
    run = _dry_run(tmp_path, None, "dev")
    assert run.returncode == 0, run.stderr
    venv = REPO / ".venv"
    assert run.stdout.splitlines()[-2:] == [
        f"{venv}/bin/pip install --quiet --upgrade pip ",
        f"{venv}/bin/pip install --quiet -e {REPO}\\[dev\\] ",
    ]


def test_the_first_run_with_a_flag_sets_up_without_an_extra(tmp_path):
    """Issue 41: ``./run_llama_train.sh --training.steps 2`` on a machine without .venv. The script sources the
    set-up, which once took the script's own ``$1`` for the pip extra (``placeholder[--training.steps]``)."""
    run = _dry_run(tmp_path, None, "--training.steps", "2", command=("./run_llama_train.sh",))
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == f"{REPO / '.venv'}/bin/pip install --quiet -e {REPO} "


def test_an_extra_that_is_no_extra_is_refused(tmp_path):
    run = _dry_run(tmp_path, None, "--training.steps")
    assert run.returncode == 2 and "pip" not in run.stdout
    assert run.stderr.strip().startswith(
        "low-bits-training: config error: ensure_venv.sh extra = '--training.steps': expected a pip extra"
    )


def test_keep_sets_up_around_the_nodes_torch(tmp_path):
    run = _dry_run(tmp_path, "2.14.1+cu126", "dev", LBT_TORCH="keep")
    assert run.returncode == 0, run.stderr
    venv = REPO / ".venv"
    out = run.stdout.splitlines()
    assert out[:2] == [
        f"python3 -m venv --system-site-packages {venv} ",
        f"# {venv}/torch-constraint.txt: torch==2.14.1+cu126",
    ]
    assert out[3] == f"{venv}/bin/python -m pip install --quiet --no-deps -e {REPO} "
    assert out[4].startswith(
        f"{venv}/bin/python -m pip install --quiet -c {venv}/torch-constraint.txt torchtitan=="
    )
    assert "torch=" not in out[4].replace("torch-constraint", "") and "hypothesis" in out[4]


def test_keep_refuses_an_old_torch_and_a_wrong_mode(tmp_path):
    old = _dry_run(tmp_path, "2.13.0", LBT_TORCH="keep")
    assert old.returncode == 2 and "python -m pip" not in old.stdout
    assert (
        old.stderr.strip()
        .splitlines()[-1]
        .startswith(f"{keep.PREFIX}: this node's torch is 2.13.0; allowed: torch >= 2.14.1")
    )
    wrong = subprocess.run(
        ["bash", "scripts/ensure_venv.sh"], cwd=REPO, env=dict(os.environ, LBT_TORCH="yes"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert wrong.returncode == 2 and wrong.stderr.strip() == (
        "low-bits-training: config error: LBT_TORCH = 'yes': expected 'keep' (the node's torch) or unset "
        "(torch==2.14.1 from the registry)"
    )
