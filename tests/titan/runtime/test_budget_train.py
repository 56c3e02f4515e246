"""End to end: a run's training-state bytes, computed from its config (titan/runtime/budget.py ``planned``), equal
the bytes its live tensors hold after the first step (``measured``, summed over ranks), state by state, for the
default debug model (torch AdamW, fp32 states) on 1 rank, the LowBitAdamW preset (int8 / e4m3 block-128 states)
on 2 FSDP2 ranks, and it with bf16 parameters on 1 rank; the run writes them to state_bytes.json, the metrics and its log."""

from __future__ import annotations

import json

import pytest

from helpers import REPO, train
from low_bits_training.run.folder import STATE_BYTES_JSON, STATE_BYTES_METRIC

DEBUG = REPO / "train_configs" / "debug_model.toml"
LOWBIT = REPO / "train_configs" / "optim" / "lowbit_adamw_int8.toml"
BF16 = ("--training.dtype", "bfloat16")
CASES = [  # (config, extra args, ranks, total bytes per parameter); each setting and each rank count once
    (DEBUG, (), 1, 16.0),
    (LOWBIT, (), 2, 10.066),
    (LOWBIT, BF16, 1, 6.066),  # bf16 params and grads: docs/memory.md
]


@pytest.mark.parametrize(("config", "args", "nproc", "total"), CASES, ids=lambda v: getattr(v, "stem", None))
def test_state_bytes_computed_equal_measured(tmp_path, config, args, nproc, total):
    shard = ("--parallelism.data_parallel_shard_degree", str(nproc))
    run = train(
        tmp_path, "--training.steps", "1", "--checkpoint.no-enable", *shard, *args, config=config, nproc=nproc
    )
    got = json.loads((run.folder / STATE_BYTES_JSON).read_text())
    assert got["ranks"] == nproc and got["params"] == 6_163_712
    plan, live = got["planned"], got["measured"]
    assert plan["bytes"] == live["bytes"]  # to the byte, every state, summed over the ranks
    assert set(plan["bytes"]) == {"params", "grads", "exp_avg", "exp_avg_sq", "step"}
    assert plan["bytes_per_param"]["total"] == pytest.approx(total, abs=1e-3)
    row = run.rows[0]
    assert row["step"] == 1 and row[f"{STATE_BYTES_METRIC}/total"] == live["bytes_per_param"]["total"]
    assert row[f"{STATE_BYTES_METRIC}/plan_total"] == plan["bytes_per_param"]["total"]
    assert run.log.count("Training state, bytes per parameter") == 1  # rank 0 logs the table, once
