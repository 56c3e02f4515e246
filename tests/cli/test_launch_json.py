""".vscode/launch.json: valid JSON, the single-process configurations set the env torchtitan needs without
torchrun, and their arguments resolve to a config (the real 2-step training is in docs/experiments.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TORCHRUN_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def configurations() -> dict[str, dict]:
    data = json.loads((REPO / ".vscode" / "launch.json").read_text())
    return {c["name"]: c for c in data["configurations"]}


def test_single_process_configs_set_torchrun_env():
    direct = [
        c for c in configurations().values() if c.get("module") == "low_bits_training.titan.launch.worker"
    ]
    assert len(direct) == 2
    for c in direct:
        assert TORCHRUN_ENV <= set(c["env"]), c["name"]
        assert c["env"]["WORLD_SIZE"] == "1" and c["env"]["RANK"] == c["env"]["LOCAL_RANK"] == "0"


def test_torchrun_and_attach_configs():
    cs = configurations()
    run = cs["lbt: torchrun 2 ranks (debugger follows the rank processes)"]
    assert run["module"] == "torch.distributed.run" and run["subProcess"] is True
    assert run["args"][run["args"].index("-m") + 1] == "low_bits_training.titan.launch.worker"
    assert cs["lbt: attach to a running rank (pick the process)"]["processId"] == "${command:pickProcess}"


@pytest.mark.parametrize("name", ["lbt: train debug model (1 process, no torchrun)"])
def test_launch_args_resolve(name, monkeypatch):
    from low_bits_training.titan.launch.configure import load_config
    from low_bits_training.titan.launch.worker import split_config_file

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("CONFIG_FILE", raising=False)
    config_file, rest = split_config_file(configurations()[name]["args"])
    config = load_config(config_file, rest)
    assert config.training.steps == 4 and config.dump_folder == "outputs/vscode_debug"
    assert not config.checkpoint.enable
