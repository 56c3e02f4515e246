"""``optim.workspace``: the update's workspace the peak planner counts under ``in_backward``, held to the
allocator's peak of real updates of parameters larger than one call (CPU, compiled update)."""

from __future__ import annotations

import pytest
import torch

from low_bits_training.optim import LowBitAdamW
from low_bits_training.optim.memory import LiveStorages, allocated_peak
from low_bits_training.optim.workspace import call_numel, per_element, update_workspace

BASE = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
CASES = {
    # the in_backward launcher test's group: stochastic rounding, so one chunk a call
    "int8 sr, e4m3, bf16 master sr": {
        "exp_avg": "int8_block128_sr",
        "exp_avg_sq": "e4m3_block128",
        "master_weights": "bf16",
        "master_rounding": "stochastic",
    },
    "defaults": {},  # no random bits: call_chunks chunks a call
    "4-bit moments": {"exp_avg": "int4_block128", "exp_avg_sq": "e2m1_block128"},
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_planned_workspace_is_the_allocators_peak_of_the_update(name):
    p = torch.nn.Parameter(torch.randn(2048, 1024))
    opt = LowBitAdamW([p], **BASE, **CASES[name])
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    p.grad = torch.randn_like(p)
    measured = allocated_peak(opt.step)
    planned = update_workspace(opt, p)
    # measured on a 65,536-element stand-in, applied to this 2M-element parameter's largest call
    assert planned == pytest.approx(measured, rel=0.02), (planned, measured)
    chunks = 1 if name.startswith("int8 sr") else opt.call_chunks
    assert call_numel(opt, p) == chunks * opt.chunk_numel
    assert per_element(opt, p) > 2  # at least a few bytes an element: fp32 temporaries of the chunk


def test_a_transient_count_is_seen_at_the_peak_and_then_gone():
    count = LiveStorages()
    count.phase = "forward and backward"
    with count:
        x = torch.empty(1000, dtype=torch.uint8)
        count.transient(5000, "optimizer step")
        assert count.now == 1000
    assert count.peak == 6000 and count.parts() == {"forward and backward": 1000, "optimizer step": 5000}
    del x
