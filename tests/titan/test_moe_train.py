"""The MoE debug preset trains with MXFP8 experts: 1 rank eager (vs the same model in high precision) and
2 FSDP2 ranks compiled; the plan names the expert weights; bad expert plans are one-line errors."""

import json

import pytest
import torch

from helpers import REPO, train, write_toml
from low_bits_training.config.plan import QuantizeConfig, QuantRule, resolve_plan
from low_bits_training.config.tree import ConfigError

MOE_TOML = REPO / "train_configs" / "debug_moe.toml"
STEPS = ("--training.steps", "3", "--checkpoint.no-enable")


def _bf16(tmp_path):
    return write_toml(tmp_path / "bf16.toml", base=MOE_TOML, quantize={"recipe": "bf16", "rules": []})


@pytest.mark.slow
def test_mxfp8_experts_train_close_to_high_precision(tmp_path):
    mx = train(tmp_path / "mx", *STEPS, config=MOE_TOML)
    hp = train(tmp_path / "hp", *STEPS, config=_bf16(tmp_path))
    assert set(mx.losses) == set(hp.losses) == {1, 2, 3}
    for s in mx.losses:
        assert abs(mx.losses[s] - hp.losses[s]) < 0.01, (mx.losses, hp.losses)
    assert mx.losses != hp.losses  # the experts really were quantized
    plan = json.loads((mx.folder / "precision_plan.json").read_text())
    w1 = plan["layers.0.moe.routed_experts.inner_experts.w1"]
    assert w1["module"] == "QuantGroupedExperts" and w1["specs"]["wgrad.input"]["block_size"] == 32
    assert plan["layers.0.moe.router.gate"]["module"] == "Linear"


@pytest.mark.slow
def test_two_fsdp_ranks_compiled(tmp_path):
    args = ("--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "1")
    run = train(tmp_path, *STEPS, *args, "--compile.enable", nproc=2, config=MOE_TOML)
    losses = list(run.losses.values())
    assert len(losses) == 3 and all(7.0 < v < 7.8 for v in losses) and losses[-1] < losses[0]


def _layers():
    from torchtitan.models.common.moe import GroupedExperts  # noqa: F401  (torchtitan after the CPU adapter)

    from low_bits_training.titan.moe import expert_layers, qwen3_moe_tiny

    return expert_layers(qwen3_moe_tiny().model_spec.model)


def test_experts_are_plan_entries_selected_by_glob():
    layers = _layers()
    assert "layers.3.moe.routed_experts.inner_experts.w2" in layers and len(layers) == 12
    cfg = QuantizeConfig(
        recipe="bf16", skip=[], rules=[QuantRule(layers=["*.inner_experts.w2"], format="e4m3")]
    )
    plans = resolve_plan(cfg, layers)
    assert [f for f, p in plans.items() if not p.is_high_precision] == [f for f in layers if f.endswith("w2")]


def test_block_that_does_not_divide_an_expert_weight_is_one_line():
    cfg = QuantizeConfig(recipe="mxfp8", skip=[], rules=[QuantRule(layers=["*"], block_size=48)])
    with pytest.raises(ConfigError, match=r"inner_experts.w1 forward.input .*block_size=48 does not divide"):
        resolve_plan(cfg, _layers())


def test_padding_dispatcher_matches_torchao_indices():
    from torchao.prototype.moe_training.ep.kernels import generate_permute_indices

    from low_bits_training.titan.moe import pad_token_groups

    g = torch.Generator().manual_seed(0)
    for ranks, experts, multiple in ((1, 4, 32), (2, 3, 16), (3, 2, 8)):
        counts = torch.randint(0, 20, (ranks * experts,), generator=g)
        counts[1] = 0
        n = int(counts.sum())
        x = torch.randn(n, 5, generator=g)
        length = -(-(n + experts * multiple) // multiple) * multiple
        ref, sizes, _ = generate_permute_indices(counts, experts, ranks, length, multiple, use_cpu=True)
        shape, padded, idx, mine = pad_token_groups(x, counts, ranks, experts, multiple)
        assert torch.equal(idx, torch.where(ref < 0, n, ref.long())) and torch.equal(mine, sizes.int())
        assert torch.equal(padded, torch.cat([x, torch.zeros(1, 5)])[idx]) and shape == (n + 1, 5)
