"""torchrun worker of test_reshard.py: FSDP2 + LowBitAdamW + DCP on CPU ranks (gloo).

``save DIR``: train 3 steps, DCP-save model + optimizer container to DIR, and write the full (gathered)
optimizer state to DIR/ref.pt. ``load DIR [OUT]``: build the same model on this world size, DCP-load DIR,
check every optimizer state (codes, scales, fp32 states, step) equals DIR/ref.pt exactly, save it again to
OUT (a checkpoint written by this world size, for the reverse direction), then take one more step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, init_device_mesh

from low_bits_training.titan.platform import cpu

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from helpers import leave_worker  # noqa: E402

if cpu.needs_cpu_adapters():
    cpu.install_device_module()

from torchtitan.components.optimizer import ParamGroupConfig  # noqa: E402

from low_bits_training.titan.runtime.optim import LowBitOptimizersContainer  # noqa: E402

KWARGS = {
    "lr": 1e-2,
    "betas": [0.9, 0.95],
    "weight_decay": 0.1,
    "exp_avg": "int8_block128",
    "exp_avg_sq": "e2m1_block32_e8m0_sr",
    "master_weights": "bf16",
    "master_rounding": "kahan",
    "min_quantized_numel": 0,
}


def build(world: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 301), nn.ReLU(), nn.Linear(301, 128))  # 301 rows: uneven shards
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model, mesh=mesh)
    model.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM / AVG reduce-scatter
    cfg = LowBitOptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="LowBitAdamW", optimizer_kwargs=KWARGS)],
        implementation="for-loop",
    )
    return model, cfg.build(model_parts=[model])


def train_step(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    x = torch.randn(8, 256, generator=g)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def full_state(opt) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in opt.state_dict().items():
        if torch.is_tensor(v):
            out[k] = (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
    return out


def save(model, opt, folder: str) -> None:
    dcp.save({"model": model.state_dict(), "optim": opt}, checkpoint_id=f"{folder}/ckpt")
    ref = full_state(opt)
    if dist.get_rank() == 0:
        torch.save(ref, f"{folder}/ref.pt")


def main(mode: str, folder: str, out: str | None = None) -> None:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    model, opt = build(world)
    if mode == "save":
        for step in range(3):
            train_step(model, opt, step)
        save(model, opt, folder)
    else:
        sd = {"model": model.state_dict(), "optim": opt}
        dcp.load(sd, checkpoint_id=f"{folder}/ckpt")
        ref = torch.load(f"{folder}/ref.pt")
        got = full_state(opt)
        assert set(got) == set(ref), sorted(set(got) ^ set(ref))
        quantized = [k for k in got if k.endswith("_codes")]
        assert quantized and any(got[k].dtype == torch.uint8 for k in quantized)
        for k, v in ref.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), f"state {k} differs after resharding"
        if out:
            save(model, opt, out)
        train_step(model, opt, 3)  # the resharded states step on
        if dist.get_rank() == 0:
            print(f"RESHARD-OK {len(ref)} tensors")
    leave_worker()


if __name__ == "__main__":
    main(*sys.argv[1:])
