"""The MoE debug preset trains with MXFP8 experts: 1 rank eager (vs the same model in high precision) and
2 FSDP2 ranks compiled; the plan names the expert weights; bad expert plans are one-line errors."""

import json

import pytest
import torch

from helpers import REPO, train, write_toml
from low_bits_training.config.quantize import QuantizeConfig, QuantRule
from low_bits_training.errors import ConfigError
from low_bits_training.plan.resolve import resolve_plan

MOE_TOML = REPO / "train_configs" / "debug_moe.toml"
STEPS = ("--training.steps", "3", "--checkpoint.no-enable")


def _bf16(tmp_path):
    return write_toml(tmp_path / "bf16.toml", base=MOE_TOML, quantize={"recipe": "bf16", "rules": []})


def test_mxfp8_experts_train_close_to_high_precision_and_switch_plans_in_a_phase(tmp_path):
    """A phase switches the experts to high precision from step 3: steps 1-2 are the MXFP8 run's, bit for
    bit (the same module and plans), step 3 leaves it and lands near the high-precision run's."""
    mx = train(tmp_path / "mx", *STEPS, config=MOE_TOML)
    hp = train(tmp_path / "hp", *STEPS, config=_bf16(tmp_path))
    assert set(mx.losses) == set(hp.losses) == {1, 2, 3}
    for s in mx.losses:
        assert abs(mx.losses[s] - hp.losses[s]) < 0.01, (mx.losses, hp.losses)
    assert mx.losses != hp.losses  # the experts really were quantized
    high = {"start": 2, "rules": [{"layers": ["*.inner_experts.*"], "format": "high"}]}
    cfg = write_toml(tmp_path / "phase.toml", base=MOE_TOML, quantize={"phases": [high]})
    phased = train(tmp_path / "phased", *STEPS, config=cfg)
    assert {s: phased.losses[s] for s in (1, 2)} == {s: mx.losses[s] for s in (1, 2)}
    assert phased.losses[3] != mx.losses[3] and abs(phased.losses[3] - hp.losses[3]) < 0.01
    assert "Precision schedule: from step 3, quantize.phases[0]: steps 3-3" in phased.log
    plan = json.loads((mx.folder / "precision_plan.json").read_text())
    w1 = plan["layers.0.moe.routed_experts.inner_experts.w1"]
    assert w1["module"] == "QuantGroupedExperts" and w1["specs"]["wgrad.input"]["block_size"] == 32
    assert plan["layers.0.moe.router.gate"]["module"] == "Linear"


def test_two_fsdp_ranks_compiled(tmp_path):
    args = ("--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "1")
    run = train(tmp_path, *STEPS, *args, "--compile.enable", nproc=2, config=MOE_TOML)
    losses = list(run.losses.values())
    assert len(losses) == 3 and all(7.0 < v < 7.8 for v in losses) and losses[-1] < losses[0]


def _layers():
    from torchtitan.models.common.moe import GroupedExperts  # noqa: F401  (torchtitan after the CPU adapter)

    from low_bits_training.titan.launch.bases import qwen3_moe_tiny
    from low_bits_training.titan.targets.experts import expert_layers

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

    from low_bits_training.titan.targets.expert_modules import pad_token_groups

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


# --- torchao's grouped experts: which backend runs them (plan.backends.grouped_backends) --------------------


@pytest.mark.parametrize(
    "recipe, backend, hardware, expect",
    [
        ("mxfp8", "auto", "cpu", ("emulate", "QuantGroupedExperts")),
        (
            "mxfp8",
            "torchao",
            "cpu",
            ("torchao_emulated", "torchao MXFP8GroupedExperts (mxfp8_emulated_rceil)"),
        ),
        ("mxfp8", "auto", "sm100", ("torchao", "torchao MXFP8GroupedExperts (mxfp8_rceil)")),
        (
            "mxfp8",
            "torchao",
            "sm90",
            ("torchao_emulated", "torchao MXFP8GroupedExperts (mxfp8_emulated_rceil)"),
        ),
        ("mxfp8", "emulate", "sm100", ("emulate", "QuantGroupedExperts")),
        ("fp8_rowwise", "auto", "sm90", ("torchao", "torchao Float8GroupedExperts (rowwise)")),
        ("fp8_rowwise", "torchao", "cpu", None),  # torchao has no emulated mode: refused (experts only here)
        ("fp8_tensorwise", "torchao", "sm100", None),  # no grouped tensorwise: refused
    ],
)
def test_expert_backend_follows_torchao_grouped_recipes(recipe, backend, hardware, expect):
    from low_bits_training.cli.doctor import hardware as named
    from low_bits_training.plan.backends import gemm_backend
    from low_bits_training.titan.targets.experts import grouped_module_label

    cfg = QuantizeConfig(recipe=recipe, backend=backend, skip=[])
    if expect is None:  # backend = "torchao" and torchao runs none of the plan's layers: one line
        with pytest.raises(
            ConfigError, match=r"^quantize.backend = 'torchao': torchao runs none .*emulated: "
        ):
            resolve_plan(cfg, _layers(), named(hardware))
        return
    plans = resolve_plan(cfg, _layers(), named(hardware))
    for fqn, plan in plans.items():
        got = {gemm_backend(plan, g) for g in ("forward", "dgrad", "wgrad")}
        assert (got, grouped_module_label(plan)) == ({expect[0]}, expect[1]), fqn


def test_hp_wgrad_mxfp8_experts_have_no_torchao_emulation():
    from low_bits_training.cli.doctor import hardware as named

    rule = QuantRule(layers=["*"], roles=["wgrad.*"], format="high")
    cfg = QuantizeConfig(recipe="mxfp8", backend="torchao", skip=[], rules=[rule])
    plans = resolve_plan(cfg, _layers(), named("sm100"))
    assert {p.backends[0] for p in plans.values()} == {"torchao"}
    with pytest.raises(ConfigError, match=r"^quantize.backend = 'torchao': torchao runs none"):
        resolve_plan(cfg, _layers(), named("cpu"))  # no emulated mode for it: every expert would fall back


def test_torchao_emulated_grouped_mxfp8_computes_the_plan():
    """torchao's ``mxfp8_emulated_rceil`` grouped GEMMs (what ``torchao_emulated`` experts run) against our
    grouped emulation of the mxfp8 plan: the same casts, so they differ only by torchao's bf16 GEMM."""
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
    from torchao.prototype.moe_training.utils import _quantize_then_scaled_grouped_mm

    from low_bits_training.nn import LinearPlan
    from low_bits_training.nn.grouped import grouped_linear
    from low_bits_training.nn.recipes import recipe_specs

    g = torch.Generator().manual_seed(0)
    e, k, n = 4, 128, 96
    x = torch.randn(4 * 64, k, generator=g).bfloat16()
    w = (torch.randn(e, n, k, generator=g) / k**0.5).bfloat16()
    dy = torch.randn(4 * 64, n, generator=g).bfloat16()
    offs = torch.tensor([64, 96, 192, 256], dtype=torch.int32)  # groups padded to 32 by the dispatcher
    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe.MXFP8_EMULATED_RCEIL)
    outs = []
    for run in (
        lambda a, b: _quantize_then_scaled_grouped_mm(a, b.transpose(-2, -1), config=config, offs=offs),
        lambda a, b: grouped_linear(a, b, offs, LinearPlan.from_roles(recipe_specs("mxfp8"))),
    ):
        a, b = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = run(a, b)
        y.backward(dy)
        outs.append((y.float(), a.grad.float(), b.grad.float()))
    high = grouped_linear(x.float(), w.float(), offs, LinearPlan())  # fp32, nothing quantized
    rel = lambda a, ref: float(((a - ref).pow(2).sum() / ref.pow(2).sum()).detach())  # noqa: E731
    assert rel(outs[1][0], high) > 1e-4  # MXFP8 changed the output (about 30 dB from fp32) ...
    for name, ao, ours in zip(("y", "dx", "dw"), *outs, strict=True):
        assert rel(ao, ours) < 1e-5, (
            name,
            rel(ao, ours),
        )  # ... torchao and ours agree to > 50 dB: bf16 output


def test_torchao_emulated_experts_train_like_ours(tmp_path):
    ao = train(tmp_path / "ao", *STEPS, "--quantize.backend", "torchao", config=MOE_TOML)
    ours = train(tmp_path / "ours", *STEPS, config=MOE_TOML)
    plan = json.loads((ao.folder / "precision_plan.json").read_text())
    w1 = plan["layers.0.moe.routed_experts.inner_experts.w1"]
    assert w1["module"] == "torchao MXFP8GroupedExperts (mxfp8_emulated_rceil)", w1["module"]
    assert set(w1["backends"].values()) == {"torchao_emulated"}
    assert set(ao.losses) == set(ours.losses) == {1, 2, 3}
    for s in ao.losses:  # the same casts; torchao's GEMMs round their outputs to bf16
        assert abs(ao.losses[s] - ours.losses[s]) < 0.01, (ao.losses, ours.losses)
