"""gloo's collectives on CPU ranks stage a whole tensor (``titan/platform/cpu.gloo_staging``, counted by the memory
planner where the ranks run on the CPU): held to the allocator's peak of both of FSDP2's collectives on 2 ranks."""

import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import free_port
from low_bits_training.optim.memory import allocated_peak
from low_bits_training.titan.platform.cpu import gloo_staging

N = 1 << 20  # elements of the whole tensor (4 MiB in fp32)


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    whole, half = torch.ones(N), torch.ones(N // 2)
    pg = dist.group.WORLD
    got = {
        "all-gather": (
            allocated_peak(lambda: dist.all_gather_into_tensor(whole, half)),
            gloo_staging(torch.ops.c10d._allgather_base_.default, (whole, half, pg)),
        ),
        "reduce-scatter": (
            allocated_peak(lambda: dist.reduce_scatter_tensor(half, whole)),
            gloo_staging(torch.ops.c10d._reduce_scatter_base_.default, (half, whole, pg)),
        ),
        "other op": (0, gloo_staging(torch.ops.aten.add.Tensor, (whole, whole))),
    }
    dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(got, f)


def test_gloo_stages_the_whole_tensor_of_fsdp2s_collectives(tmp_path):
    out = tmp_path / "got.json"
    mp.spawn(_rank, args=(free_port(), str(out)), nprocs=2)
    got = json.loads(out.read_text())
    assert got == {"all-gather": [4 * N, 4 * N], "reduce-scatter": [4 * N, 4 * N], "other op": [0, 0]}, got
