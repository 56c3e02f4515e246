"""``scripts/gpu_check.sh`` on this GPU-less machine: the dry run lists every level and item it would run and
why none can run here (JSON); the level-1 and level-2 checks themselves, run CPU against CPU."""

import json
import subprocess

import pytest

from helpers import REPO
from low_bits_training.formats import FORMATS
from low_bits_training.nn.recipes import RECIPES
from low_bits_training.speed import gpu_checks


def test_dry_run_lists_every_level_and_item(tmp_path):
    p = subprocess.run(
        [str(REPO / "scripts" / "gpu_check.sh"), "--dry-run", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] is True and report["results"] == []
    levels = {lv["level"]: lv for lv in report["levels"]}
    assert sorted(levels) == [0, 1, 2, 3]
    for lv in levels.values():  # no GPU here: nothing runs, and each level says why
        assert lv["available"] is False and "no CUDA device visible" in lv["why"]
    one = levels[1]["items"]
    assert one[0] == "import survey"
    assert {f"cast {f} nearest" for f in FORMATS} <= set(one)
    assert {f"QuantLinear cuda == cpu: {r}" for r in RECIPES if r != "bf16"} <= set(one)
    assert {"_scaled_mm vs emulation: fp8_tensorwise", "_scaled_mm vs emulation: fp8_rowwise"} <= set(one)
    assert "speed mxfp8 8192x4096x14336" in one
    assert "torchao vs emulation: mxfp8" in levels[2]["items"]
    assert levels[3]["items"][0].startswith("train debug model: 6 compiled steps, fp8_rowwise")
    assert "level 1 (torch only): cannot run here (no CUDA device visible); " in p.stdout


def test_bad_levels_are_one_line_and_exit_code_2(tmp_path):
    cmd = [str(REPO / "scripts" / "gpu_check.sh"), "--levels", "1,7", "--out", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("gpu_check: config error: --levels = '1,7': expected")


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "bf16"])
def test_recipe_parity_check_runs_cpu_against_cpu(recipe):
    row = gpu_checks.recipe_parity(recipe, ("cpu", "cpu"))
    assert row["status"] == "ok" and row["max_rel_diff"] == 0.0, row


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_cast_parity_check_runs_cpu_against_cpu(fmt):
    for rounding in gpu_checks.CAST_ROUNDINGS:
        assert gpu_checks.cast_parity(fmt, rounding, ("cpu", "cpu"))["status"] == "ok"


def test_scaled_mm_and_torchao_checks_run_on_cpu():
    for recipe in gpu_checks.REAL_RECIPES:  # torch._scaled_mm runs on CPU too
        assert gpu_checks.real_vs_emulation(recipe, "cpu")["status"] == "ok"
    row = gpu_checks.torchao_vs_emulation("fp8_rowwise", "cpu", emulated=True)
    # bf16 inputs: our rowwise GEMM is a bf16 GEMM, torchao's emulation an fp32 one (docs/precision_plan.md,
    # "torchao against our emulation"): equal where oneDNN sums in the same order (a CPU without bf16 dot
    # products), one bf16 ulp apart on a few elements where it does not (AMD EPYC with AVX512-BF16, 2026-11-26:
    # 1 of 98,304 output elements, 0.0030 of the largest value)
    assert row["status"] == "ok" and row["max_rel_diff"] <= 2.0**-7
