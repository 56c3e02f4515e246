"""The torchtitan container plumbing: names resolve, kwargs are checked, the config swap keeps every field."""

from __future__ import annotations

import pytest
import torch
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

from low_bits_training.errors import ConfigError
from low_bits_training.optim import LowBitAdamW
from low_bits_training.titan.runtime.optim import (
    LowBitOptimizersContainer,
    adapt_optimizer_config,
    check_group,
)


class _Cfg:
    def __init__(self, groups):
        self.optimizer = OptimizersContainer.Config(param_groups=groups, implementation="for-loop")
        self.dump_folder = "/tmp/unused"


def test_names_resolve_to_ours_torchao_and_torchtitan():
    import torchao.optim

    resolve = LowBitOptimizersContainer._resolve_optimizer_factory
    assert resolve("LowBitAdamW") is LowBitAdamW
    assert resolve("AdamW8bit") is torchao.optim.AdamW8bit and resolve("AdamWFp8") is torchao.optim.AdamWFp8
    assert resolve("AdamW") is torch.optim.AdamW


def test_adapt_swaps_the_container_only_when_needed_and_keeps_fields():
    plain = _Cfg([ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1.0})])
    adapt_optimizer_config(plain)
    assert type(plain.optimizer) is OptimizersContainer.Config
    ours = _Cfg(
        [
            ParamGroupConfig(pattern="x", optimizer_name="LowBitAdamW", optimizer_kwargs={"lr": 1.0}),
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1.0}),
        ]
    )
    adapt_optimizer_config(ours)
    assert isinstance(ours.optimizer, LowBitOptimizersContainer.Config)
    assert ours.optimizer.implementation == "for-loop" and len(ours.optimizer.param_groups) == 2


@pytest.mark.parametrize(
    ("name", "kwargs", "needle"),
    [
        (
            "LowBitAdam",
            {"lr": 1.0},
            "optimizer.param_groups[1].optimizer_name = 'LowBitAdam': allowed Adam, AdamW",
        ),
        (
            "LowBitAdamW",
            {"lr": 1.0, "exp_avg": "e4m3_block7x"},
            "optimizer.param_groups[1].optimizer_kwargs.exp_avg=",
        ),
        ("LowBitSGD", {"lr": 1.0, "momentum_buffer": "int16"}, "optimizer_kwargs.momentum_buffer='int16'"),
        ("AdamW8bit", {"lr": 1.0, "block_size": 64}, "optimizer_kwargs.block_size: not a AdamW8bit option"),
    ],
)
def test_bad_groups_are_one_line_config_errors(name, kwargs, needle):
    with pytest.raises(ConfigError) as e:
        check_group(1, name, kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_container_mixes_lowbit_and_torch_groups_and_steps():
    model = torch.nn.Sequential(torch.nn.Linear(128, 64), torch.nn.LayerNorm(64))
    cfg = LowBitOptimizersContainer.Config(
        implementation="for-loop",
        param_groups=[
            ParamGroupConfig(
                pattern=r"^0\.weight",
                optimizer_name="LowBitAdamW",
                optimizer_kwargs={"lr": 1e-2, "min_quantized_numel": 0},
            ),
            ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-2}),
        ],
    )
    opt = cfg.build(model_parts=[model])
    model(torch.randn(4, 128)).sum().backward()
    opt.step()
    sd = opt.state_dict()
    assert (
        sd["state.0.weight.exp_avg_codes"].dtype == torch.uint8
        and sd["state.1.bias.exp_avg"].dtype == torch.float32
    )
