"""The one launcher run of the fast tier (``./run_tests.sh``): the user's command on one CPU rank trains, its
loss falls, and the run folder holds what the README says. The full tier (``--all``) runs the rest
(2 ranks, parallelisms, resume, compile: tests/titan)."""

import pytest

from helpers import train
from low_bits_training.run.folder import COMMAND_TXT, CONFIG_JSON, CONFIG_TOML, METRICS_FILE


@pytest.mark.smoke
def test_the_launcher_trains_the_debug_model(tmp_path):
    run = train(tmp_path, "--training.steps", "6", "--checkpoint.interval", "6")
    assert run.returncode == 0
    loss = run.losses
    assert sorted(loss) == [1, 2, 3, 4, 5, 6]
    assert 7.5 < loss[1] < 8.5  # ~log(2048): an untrained model over the debug model's vocabulary
    assert loss[6] < loss[1] - 0.5, loss
    for name in (CONFIG_TOML, CONFIG_JSON, COMMAND_TXT, METRICS_FILE):
        assert (run.folder / name).is_file(), name
    assert [p.name for p in (run.folder / "checkpoint").iterdir()] == ["step-6"]
