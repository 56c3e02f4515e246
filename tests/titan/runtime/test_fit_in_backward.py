"""The fit planner offers the low-bit optimizers' updates in the backward (``in_backward``: no gradients held)
where the run allows them, between activation checkpointing and a smaller local batch, and the change it plans
is undone after (``titan/runtime/peak_fit.py``). Planned through lbt-doctor --fit: docs/memory.md."""

from __future__ import annotations

import copy
import math

from helpers import DEBUG_TOML, REPO
from low_bits_training.titan.launch.configure import load_config
from low_bits_training.titan.runtime.peak_fit import _candidates, _changed

LEAN = REPO / "train_configs" / "debug_lean.toml"
OFFER = "optimizer_kwargs.in_backward = true in optimizer.param_groups[0] with --training.max_norm inf"


def test_offered_after_ac_and_before_the_batch_and_undone_after_planning():
    config = load_config(LEAN, ["--training.local_batch_size", "4"])
    changes = dict(_candidates(config, 1))
    assert list(changes) == [
        "--activation_checkpoint selective",
        "--activation_checkpoint full",
        OFFER,
        "--training.local_batch_size 2 --training.global_batch_size 4",
        "--training.local_batch_size 1 --training.global_batch_size 4",
    ]
    kwargs = config.optimizer.param_groups[0].optimizer_kwargs
    before, norm = copy.deepcopy(kwargs), config.training.max_norm
    with _changed(config, changes[OFFER]):
        assert kwargs["in_backward"] is True and config.training.max_norm == math.inf
    assert kwargs == before and "in_backward" not in kwargs and config.training.max_norm == norm


def test_not_offered_where_the_run_cannot_take_it():
    lean = load_config(LEAN, [])
    assert OFFER in dict(_candidates(lean, 2))  # FSDP2 runs the hooks on each shard after its reduce-scatter
    replicated = load_config(LEAN, ["--parallelism.data_parallel_replicate_degree", "2"])
    assert OFFER not in dict(_candidates(replicated, 2))  # DDP reduces the gradients after the backward
    assert OFFER not in dict(_candidates(load_config(LEAN, ["--quantize.autopilot.enable"]), 1))
    assert OFFER not in dict(_candidates(load_config(LEAN, ["--training.global_batch_size", "16"]), 1))
    assert not any(
        "in_backward" in c for c in dict(_candidates(load_config(DEBUG_TOML, []), 1))
    )  # torch AdamW
