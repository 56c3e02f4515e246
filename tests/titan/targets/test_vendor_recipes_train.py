"""Issue 38's vendor-equal recipes through the launcher as users run it (debug model, 3 steps, eager, 1 CPU
rank): ``nvfp4_torchao`` (torchao's NVFP4 training arithmetic) and ``fp8_block_te_exact`` (TE's blockwise fp8
with exact scales) train, and the run's plan names their options. Their numerics: tests/formats
(test_nvfp4_torchao.py, test_fp8_block_te.py)."""

import math

import pytest

from helpers import train, write_toml

STEPS = ("--training.steps", "3", "--checkpoint.no-enable", "--debug.seed", "0")


@pytest.mark.parametrize(
    ("recipe", "label"), [("nvfp4_torchao", "aoorder"), ("fp8_block_te_exact", "teorder")]
)
def test_vendor_recipe_trains(tmp_path, recipe, label):
    cfg = write_toml(tmp_path / "c.toml", quantize={"recipe": recipe})
    run = train(tmp_path, *STEPS, config=cfg)
    loss = run.losses
    assert sorted(loss) == [1, 2, 3] and all(math.isfinite(v) for v in loss.values()), loss
    assert loss[3] < loss[1], loss
    assert label in run.log, run.log[-3000:]
