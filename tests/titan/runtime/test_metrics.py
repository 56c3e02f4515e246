"""What the metrics writer logs (titan/runtime/metrics.py): the run's last step always, which row of a process
start holds its warm-up, and no MFU on the CPU; read back by the one run-folder reader (report/runs.py)."""

from __future__ import annotations

import json

import pytest

from low_bits_training.run.folder import FIRST_LOG, TPS


def _processor(tmp_path, steps: int, log_freq: int):
    from torchtitan.distributed import ParallelDims

    from low_bits_training.titan.runtime.metrics import LowBitsMetricsProcessor

    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
    config = LowBitsMetricsProcessor.Config(log_freq=log_freq)
    return config.build(
        parallel_dims=dims, dump_folder=str(tmp_path), config_dict={"training": {"steps": steps}}
    )


@pytest.mark.parametrize(("steps", "log_freq", "logged"), [(6, 5, [1, 5, 6]), (12, 5, [1, 5, 10, 12]),
                                                           (4, 10, [1, 4]), (10, 5, [1, 5, 10])])  # fmt: skip
def test_the_last_step_is_always_logged(tmp_path, steps, log_freq, logged):
    mp = _processor(tmp_path, steps, log_freq)
    assert [s for s in range(1, steps + 1) if mp.should_log(s)] == logged
    mp.close()


def test_no_mfu_against_an_a100_peak_on_the_cpu(tmp_path):
    mp = _processor(tmp_path, 2, 1)
    mp.num_flops_per_token, mp.ntokens_since_last_log = 1000, 256
    mp.data_loading_times.append(0.0)
    mp.log(1, 8.0, 8.0, 1.0)
    mp.close()
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert "mfu(%)" not in row and row["tflops"] > 0  # the achieved rate stays, the ratio to a GPU goes


def test_a_process_marks_its_first_training_row(tmp_path):
    from low_bits_training.titan.runtime.metrics import JsonlLogger

    path = tmp_path / "metrics.jsonl"
    for steps in ((1, 2, 3), (3, 4)):  # a run, then a resume that redoes step 3
        logger = JsonlLogger(str(path))
        for s in steps:
            logger.log({TPS: 100.0 * s, "loss_metrics/global_avg_loss": 1.0 / s}, s)
            logger.log({"validation_metrics/loss": 1.0}, s)  # a validation row says nothing about it
        logger.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["step"], r[FIRST_LOG]) for r in rows if TPS in r] == [
        (1, True), (2, False), (3, False), (3, True), (4, False)
    ]  # fmt: skip
    assert all(FIRST_LOG not in r for r in rows if TPS not in r)
