"""The byte budget computed from the config (optim/budget.py) equals the bytes the live tensors hold after a
step, state by state, for torch's AdamW, our low-bit optimizers and torchao's; FSDP2 runs: the launcher test
tests/titan/runtime/test_budget_train.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from low_bits_training.optim import LowBitAdamW, LowBitSGD
from low_bits_training.optim.budget import Sharding, state_bytes
from low_bits_training.optim.live_bytes import live_bytes


def _model() -> nn.Module:
    torch.manual_seed(0)
    # a 2-D weight of 128-blocks, one whose rows are not (100 columns: fp32 states), a norm vector (fp32)
    return nn.ModuleDict(
        {"a": nn.Linear(256, 512, bias=False), "b": nn.Linear(100, 64, bias=False), "norm": nn.LayerNorm(256)}
    )


def _stepped(model: nn.Module, opt) -> None:
    loss = sum((p.float() ** 2).sum() for p in model.parameters())
    loss.backward()
    opt.step()


def _computed(model: nn.Module, name: str, group: dict, sharding: Sharding | None = None):
    return state_bytes(
        ((n, tuple(p.shape), name, group) for n, p in model.named_parameters()), sharding or Sharding()
    )


def _measured(model: nn.Module, opt):
    return live_bytes(list(model.parameters()), [opt.state[p] for p in model.parameters()])


CASES = [
    ("AdamW", {"lr": 1e-3, "weight_decay": 0.1}),
    ("AdamW", {"lr": 1e-3, "amsgrad": True}),
    ("LowBitAdamW", {"lr": 1e-3, "exp_avg": "int8_block128", "exp_avg_sq": "e4m3_block128", "fused": False}),
    (
        "LowBitAdamW",
        {"lr": 1e-3, "exp_avg": "bf16", "exp_avg_sq": "int4_block32_e8m0", "master_weights": "bf16"}
        | {"master_rounding": "kahan", "fused": False},
    ),
    ("LowBitSGD", {"lr": 1e-3, "momentum_buffer": "e2m1_block32_e8m0", "fused": False}),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("name", "group"), CASES, ids=lambda c: c if isinstance(c, str) else "")
def test_computed_bytes_equal_the_live_tensors_after_a_step(name, group, dtype):
    model = _model().to(dtype)
    factory = {"AdamW": torch.optim.AdamW, "LowBitAdamW": LowBitAdamW, "LowBitSGD": LowBitSGD}[name]
    opt = factory(model.parameters(), **group)
    _stepped(model, opt)
    computed, measured = _computed(model, name, group, Sharding(param_dtype=dtype)), _measured(model, opt)
    assert computed.numel == measured.numel == 256 * 512 + 100 * 64 + 2 * 256
    assert computed.nbytes == measured.nbytes  # to the byte, every state


def test_int8_block128_is_1_plus_4_over_128_bytes_and_the_default_adamw_16():
    w = [("w", (512, 256), "LowBitAdamW", {"lr": 1.0, "exp_avg": "int8_block128", "exp_avg_sq": "fp32"})]
    b = state_bytes(w).per_param()
    assert b["exp_avg"] == 1 + 4 / 128 and b["exp_avg_sq"] == 4.0 and b["params"] == b["grads"] == 4.0
    adamw = state_bytes([("w", (512, 256), "AdamW", {"lr": 1.0})]).per_param()
    assert adamw["total"] - adamw["step"] == 16.0
    bf16 = state_bytes([("w", (512, 256), "AdamW", {"lr": 1.0})], Sharding(param_dtype=torch.bfloat16))
    assert bf16.per_param()["total"] - bf16.per_param()["step"] == 8.0


def test_fsdp_shards_pad_params_and_grads_only():
    # 5 rows over 2 ranks: FSDP2 pads the sharded params and grads to 6 rows; states hold the 3 + 2 real rows
    one = state_bytes([("w", (5, 256), "AdamW", {"lr": 1.0})])
    two = state_bytes([("w", (5, 256), "AdamW", {"lr": 1.0})], Sharding(shards=2))
    assert two.nbytes["params"] == two.nbytes["grads"] == 6 * 256 * 4
    assert two.nbytes["exp_avg"] == one.nbytes["exp_avg"] == 5 * 256 * 4
    assert two.nbytes["step"] == 2 * one.nbytes["step"] == 8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["AdamW8bit", "AdamW4bit", "AdamWFp8"])
def test_torchao_states_match_their_layout(name, dtype):
    import torchao.optim

    model = _model().to(dtype)
    opt = getattr(torchao.optim, name)(model.parameters(), lr=1e-3)
    for p in model.parameters():  # the states torchao's first step makes (its step compiles: seconds)
        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": opt._new_buffer(p, True)}
        opt.state[p]["exp_avg_sq"] = opt._new_buffer(p, False)
    sum((p**2).sum() for p in model.parameters()).backward()
    assert (
        _computed(model, name, {"lr": 1e-3}, Sharding(param_dtype=dtype)).nbytes
        == _measured(model, opt).nbytes
    )


def test_an_optimizer_without_a_byte_model_is_named():
    with pytest.raises(ValueError, match="no byte model for optimizer 'DistMuon'"):
        state_bytes([("w", (4, 4), "DistMuon", {"lr": 1.0})])
