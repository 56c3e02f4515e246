"""QuantLinear on TP shards (2 gloo ranks) equals the unsharded layer: colwise and rowwise weights.

Scales that reduce over a sharded dim are all-reduced (tensorwise, rowwise along K in rowwise-parallel), block
scales stay inside a shard; either way the sharded layer must reproduce the single-device numbers.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from nn_helpers import operands, plan_for

from helpers import free_port, leave_worker

RECIPES = ("fp8_tensorwise", "fp8_rowwise", "mxfp8", "int8")


def _worker(rank: int, port: int, out: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from low_bits_training.nn import linear, quant_linear

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    torch.set_num_threads(1)
    x, w, dy = operands(m=64, k=128, n=192)
    for recipe in RECIPES:
        plan = plan_for(recipe)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        yr = quant_linear(xr, wr, None, plan)
        yr.backward(dy)
        for style, xp, wp in (("colwise", Replicate(), Shard(0)), ("rowwise", Shard(1), Shard(1))):
            xd = distribute_tensor(x, mesh, [xp]).requires_grad_()
            wd = distribute_tensor(w, mesh, [wp]).requires_grad_()
            y = linear(xd, wd, None, plan)
            y.backward(
                distribute_tensor(dy, mesh, [Replicate()]).redistribute(mesh, y.placements)
                if not y.placements[0].is_partial()
                else distribute_tensor(dy, mesh, [Replicate()])
            )
            full = [t.full_tensor() for t in (y, xd.grad, wd.grad)]
            if rank == 0:
                out[(recipe, style)] = [
                    (a - b).abs().max().item() / b.abs().max().item()
                    for a, b in zip(full, (yr, xr.grad, wr.grad), strict=True)
                ]
    leave_worker()


def test_tp_shards_match_unsharded():
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), out), nprocs=2, join=True)
    assert len(out) == 2 * len(RECIPES)
    for key, errs in out.items():
        # Same quantization on every element; only the summation order of the partial sums may differ.
        assert max(errs) < 1e-5, f"{key}: relative errors (output, grad_input, grad_weight) {errs}"


def test_errors_name_the_role():
    # A spec that cannot be cast on a shard is refused naming the GEMM operand (role), the spec and the dim.
    from low_bits_training.formats import QuantSpec
    from low_bits_training.nn.cast import cast

    nvfp4 = QuantSpec.nvfp4(axis=1)
    with pytest.raises(NotImplementedError, match=r"^quantize: dgrad.weight \(e2m1/block16.*sharded dim 1;"):
        cast(torch.randn(32, 64), nvfp4, ((1, None),), role="dgrad.weight")
    with pytest.raises(ValueError, match=r"^wgrad.input \(40, 64\) \(e2m1/block16@0.*block_size=16 does not"):
        cast(torch.randn(40, 64), QuantSpec.nvfp4(axis=0), role="wgrad.input")
