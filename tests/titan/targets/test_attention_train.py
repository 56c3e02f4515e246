"""Quantized attention GEMMs in the torchtitan model (titan/targets/attention.py): swapped in only where the plan
names the attention products, equal to the CPU adapter's attention in high precision, refused in one line
where it cannot run, and training the debug model (train_configs/recipes/debug_fp8_attention.toml)."""

import re
from collections import namedtuple

import pytest
import torch

from helpers import REPO, train, write_toml
from low_bits_training.config.quantize import QuantRule
from low_bits_training.errors import ConfigError
from low_bits_training.nn import LinearPlan

PRESET = REPO / "train_configs" / "recipes" / "debug_fp8_attention.toml"
FP8 = QuantRule(layers=["layers.*.attention.qk", "layers.*.attention.pv"], format="e4m3", scaling="tensor")


def _config(recipe: str = "fp8_tensorwise", rules=(), **parallelism):
    from low_bits_training.titan.launch.configure import load_config

    config = load_config(REPO / "train_configs" / "debug_model.toml", [])
    config.quantize.recipe, config.quantize.rules = recipe, list(rules)
    for key, value in parallelism.items():
        setattr(config.parallelism, key, value)
    return config


def _inner(config) -> list:
    return [layer.attention.inner_attention for layer in config.model_spec.model.layers]


def test_nothing_selects_attention_nothing_changes():
    from low_bits_training.titan.targets.registry import apply_run, current_plans

    config = _config()
    before = _inner(config)
    plans = apply_run(config).plans
    assert _inner(config) == before and all(a is b for a, b in zip(_inner(config), before, strict=True))
    assert (
        plans["layers.0.attention.qk"].is_high_precision and plans["layers.5.attention.pv"].is_high_precision
    )
    assert current_plans(config)[1]["layers.0.attention.qk"] == "FlexAttention"


def test_named_products_swap_the_inner_attention():
    from low_bits_training.titan.targets.attention import quant_attention_class
    from low_bits_training.titan.targets.registry import apply_run, current_plans

    config = _config(rules=[QuantRule(layers=["layers.[01].attention.qk"], format="e4m3", scaling="tensor")])
    apply_run(config)
    kinds = [type(c) for c in _inner(config)]
    assert (
        kinds[:2] == [quant_attention_class().Config] * 2 and quant_attention_class().Config not in kinds[2:]
    )
    assert _inner(config)[0].plans["pv"].is_high_precision and _inner(config)[0].fqn == "layers.0.attention"
    assert current_plans(config)[1]["layers.1.attention.pv"] == "QuantAttention"


def test_tensor_parallel_quantized_attention_is_refused():
    from low_bits_training.titan.targets.registry import apply_run

    with pytest.raises(ConfigError, match=r"^parallelism.tensor_parallel_degree = 2: quantized attention"):
        apply_run(_config(rules=[FP8], tensor_parallel_degree=2))


def test_high_precision_quant_attention_is_the_cpu_adapters_attention():
    """The module (BlockMask interface, dense mask, GQA) with a high-precision plan: the adapter's numbers."""
    from low_bits_training.titan.platform.cpu import _dense_attention_class
    from low_bits_training.titan.targets.attention import quant_attention_class

    def documents(b, h, q, kv):  # causal within two packed documents
        return (q >= kv) & ((q < 40) == (kv < 40))

    mask = namedtuple("Mask", "mask_mod")(documents)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 64, 4, 32, generator=g), *torch.randn(2, 2, 64, 2, 32, generator=g)
    dense = _dense_attention_class()(_dense_attention_class().Config())
    ours = quant_attention_class()(quant_attention_class().Config(plans={"qk": LinearPlan()}, fqn="a"))
    want = dense(q, k, v, attention_masks=mask, enable_gqa=True)
    got = ours(q, k, v, attention_masks=mask, enable_gqa=True)
    torch.testing.assert_close(got, want)


def test_bad_block_size_through_the_launcher(tmp_path):
    rule = {"layers": ["layers.*.attention.qk"], "format": "e4m3", "scaling": "block", "block_size": 48}
    run = train(tmp_path, config=write_toml(tmp_path / "bad.toml", quantize={"rules": [rule]}), check=False)
    lines = [line for line in run.log.strip().splitlines() if line.startswith("low-bits-training:")]
    assert run.returncode == 2, run.log[-3000:]
    assert lines == [
        "low-bits-training: config error: quantize.rules[0]: layers.0.attention.qk forward.input: block_size = 48 "
        "does not divide head_dim = 16 (Q, blocked along head_dim in the forward GEMM); use a divisor of 16 or "
        "exclude the role"
    ], run.log[-3000:]
    assert not (run.folder / "precision_plan.txt").exists()


def test_debug_model_trains_with_fp8_attention(tmp_path):
    steps = ("--training.steps", "10", "--checkpoint.no-enable")
    base = train(tmp_path / "base", *steps).losses
    fp8 = train(tmp_path / "fp8", *steps, config=PRESET)
    loss = fp8.losses
    assert sorted(loss) == list(range(1, 11))
    assert loss[10] < loss[1] - 1.0, loss
    # fp8 attention + fp8 linears against the fp32 run from the same seed (the preset is debug_model.toml plus
    # [quantize]): step 1 within 0.01, the mean of the last three steps within 0.05 (measured: 0.0002 and
    # 0.0036; before the preset had the seed, both runs started from different weights and differed by ~0.2)
    assert abs(loss[1] - base[1]) < 0.01, (loss, base)
    last = [8, 9, 10]
    assert abs(sum(loss[s] - base[s] for s in last) / 3) < 0.05, (loss, base)
    table = (fp8.folder / "precision_plan.txt").read_text()
    assert re.search(
        r"^layers\.\[0-5\]\.attention\.qk +QuantAttention +forward\.input +e4m3/tensor", table, re.M
    ), table


def test_a_phase_that_quantizes_attention_later_builds_it_from_the_start():
    """Attention products switch plans mid-run: a module quantized only in a later phase is built as
    QuantAttention with its step-1 plans (high precision)."""
    from low_bits_training.config.quantize import Phase
    from low_bits_training.titan.targets.attention import quant_attention_class
    from low_bits_training.titan.targets.registry import apply_run, current_plans

    config = _config()
    config.quantize.phases = [Phase(start=0.5, rules=[FP8])]
    run = apply_run(config)
    assert run.switchable("layers.0.attention.qk") and "layers.3.attention.pv" in run.keep()
    inner = _inner(config)
    assert all(type(c) is quant_attention_class().Config for c in inner)
    assert all(p.is_high_precision for c in inner for p in c.plans.values())
    assert current_plans(config)[1]["layers.0.attention.qk"] == "QuantAttention"
    assert not run.schedule.at(31).plans["layers.0.attention.qk"].is_high_precision


def test_a_product_switched_mid_run_computes_as_one_built_with_that_plan():
    """Setting a product's plan (what a phase or the autopilot does between steps) rebuilds the module's
    AttentionPlan: outputs and gradients equal a module built with that plan, bit for bit, and switching
    back gives the first plan's numbers again."""
    from low_bits_training.titan.targets.attention import quant_attention_class
    from low_bits_training.titan.targets.registry import resolve_run

    cls = quant_attention_class()
    fp8 = resolve_run(_config(rules=[FP8])).plans["layers.0.attention.qk"]
    mask = namedtuple("Mask", "mask_mod")(lambda b, h, q, kv: q >= kv)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 64, 4, 16, generator=g) for _ in range(3))

    def run(module):
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = module(qq, kk, vv, attention_masks=mask)
        out.square().sum().backward()
        return out.detach(), qq.grad, kk.grad, vv.grad

    switched = cls(cls.Config(plans={"qk": LinearPlan()}, fqn="layers.0.attention"))
    high = run(switched)
    switched.qk.plan = fp8
    assert switched.plan.qk is fp8 and not switched.plan.is_high_precision
    built = cls(cls.Config(plans={"qk": fp8}, fqn="layers.0.attention"))
    want, got = run(built), run(switched)
    assert not torch.equal(want[0], high[0])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    switched.qk.plan = LinearPlan()
    for a, b in zip(run(switched), high, strict=True):
        assert torch.equal(a, b)


def test_quantized_attention_too_big_for_the_device_is_one_line():
    """8 x 16 heads x 8192^2 x 4 B = 34.4 GB per module: refused against a 24 GB device, before any build;
    full activation checkpointing keeps one module's matrix (the estimate drops), and 128 tokens pass."""
    from low_bits_training.titan.targets.attention import check_attention_memory, dense_bytes
    from low_bits_training.titan.targets.registry import resolve_run

    config = _config("bf16", [FP8])
    config.training.seq_len, config.training.local_batch_size = 8192, 8
    plans = resolve_run(config).plans
    one, peak = dense_bytes(config, 6)
    assert one == 8 * 16 * 8192**2 * 4 and peak == one * (6 + 4)
    with pytest.raises(ConfigError) as e:
        check_attention_memory(config, plans, 24 * 10**9)
    line = str(e.value)
    assert "\n" not in line and line.startswith(
        "quantize: 6 quantized attention modules keep a dense fp32 (batch x heads x seq x seq) matrix each: "
        "8 x 16 x 8192 x 8192 x 4 B = 34.4 GB, about 343.6 GB at the backward's peak, more than this device's "
        "24.0 GB; lower training.seq_len"
    )
    check_attention_memory(config, plans, 400 * 10**9)  # fits
    check_attention_memory(config, {}, 1)  # nothing quantized: nothing to hold
    from torchtitan.distributed.activation_checkpoint import FullAC

    config.activation_checkpoint = FullAC.Config()
    assert dense_bytes(config, 6)[1] == one * (1 + 4)


def test_the_launcher_refuses_it_before_any_rank_starts(tmp_path, capsys):
    from low_bits_training.titan.launch import launcher

    rule = {
        "layers": ["layers.*.attention.qk", "layers.*.attention.pv"],
        "format": "e4m3",
        "scaling": "tensor",
    }
    cfg = write_toml(tmp_path / "att.toml", quantize={"rules": [rule]})
    args = [
        "--training.seq_len",
        "8192",
        "--training.local_batch_size",
        "8",
        "--dump_folder",
        str(tmp_path / "r"),
    ]
    code = launcher.main([launcher.CHECK_ONLY, "--", "--config-file", str(cfg), *args])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and len(err) == 1 and "quantized attention modules keep a dense fp32" in err[0]
    assert not (tmp_path / "r").exists()
