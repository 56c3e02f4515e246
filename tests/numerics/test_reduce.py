"""Statistics reduced over 2 gloo ranks equal the statistics of the whole tensor on one rank."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import free_port, leave_worker
from low_bits_training.formats import QuantSpec
from low_bits_training.numerics import operand_stats, summarize
from low_bits_training.titan.runtime.numerics import reduce_raw

SPECS = [QuantSpec.mxfp8("e4m3"), QuantSpec.int8_rowwise(), QuantSpec("e2m1", "block", block_size=16)]


def _data() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 64, generator=g) * torch.logspace(-8, 3, 8).unsqueeze(1)  # (8, 64), wide range


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = _data()[rank * 4 : (rank + 1) * 4]  # each rank holds half the rows (data parallel)
    raw = torch.stack([operand_stats(x, s) for s in SPECS])
    reduce_raw(raw)
    torch.save(raw, f"{out}.{rank}")
    leave_worker()


def test_two_rank_reduction_equals_one_rank(tmp_path):
    out = str(tmp_path / "raw")
    mp.start_processes(_worker, args=(free_port(), out), nprocs=2, join=True, start_method="spawn")
    r0, r1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    torch.testing.assert_close(r0, r1, rtol=0, atol=0)  # every rank ends with the same numbers
    whole = torch.stack([operand_stats(_data(), s) for s in SPECS])
    torch.testing.assert_close(r0, whole, rtol=1e-12, atol=0)
    for a, b in zip(r0, whole, strict=True):
        sa, sb = summarize(a), summarize(b)
        assert sa["sqnr_db"] == pytest.approx(sb["sqnr_db"], rel=1e-12)  # from summed energies
        assert sa["underflow"] == sb["underflow"] and sa["hist"] == sb["hist"]
        assert sa["scale_min"] == sb["scale_min"] and sa["amax"] == sb["amax"]
    assert summarize(r0[2])["underflow"] > 0.01  # e2m1: values below scale/4 flush to zero
