"""The torchao backend on CPU: torchao's modules in their emulated modes held against our emulation of the
same plan (forward output, grad_input, grad_weight), their configs against torchao's named recipes, compile.

Stated bounds (docs/precision_plan.md): fp32 inputs: fp8_rowwise, fp8_rowwise_hp_wgrad and mxfp8 equal ours bit
for bit; fp8_tensorwise within 4e-7 of the largest value (torchao multiplies by amax-derived 448/amax, we
divide by amax/448). bf16 inputs: fp8_rowwise bit for bit; the others differ in under 0.1% of elements (measured
0.001-0.03%), the difference at least 80 dB below the signal (measured 82-160 dB): torchao's emulated GEMMs and
its high-precision weight gradient run in bf16 where ours accumulate in fp32 and round once.
"""

import dataclasses

import pytest
import torch
from torchtitan.models.common.linear import Linear

from low_bits_training.config.quantize import QuantizeConfig, QuantRule, TorchaoOptions
from low_bits_training.nn import LinearPlan, quant_linear, torchao_modules
from low_bits_training.nn.torchao_recipes import torchao_recipe
from low_bits_training.plan.resolve import LayerShape, resolve_plan
from low_bits_training.titan.targets.torchao_backend import (
    TorchaoFloat8Linear,
    TorchaoMXFP8Linear,
    float8_config,
    float8_label,
    layer_config,
)

K, N, M = 256, 384, 256


def operands(m: int, k: int, n: int, dtype=torch.float32, seed: int = 0):
    """x (m,k) with a few outlier channels, w (n,k), dy (m,n) (as tests/nn/nn_helpers.py makes them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * (1 + 4 * (torch.rand(k, generator=g) > 0.95))
    w = torch.randn(n, k, generator=g) / k**0.5
    dy = torch.randn(m, n, generator=g) * 1e-3
    return x.to(dtype), w.to(dtype), dy.to(dtype)


def torchao_layer(recipe: str, dtype=torch.float32, rules=(), opts: TorchaoOptions | None = None):
    """(module, plan) for one 256 -> 384 layer under backend torchao on this CPU."""
    opts = opts or TorchaoOptions()
    cfg = QuantizeConfig(recipe=recipe, backend="torchao", skip=[], rules=list(rules))
    plan = resolve_plan(cfg, {"w": LayerShape(K, N, M)})["w"]
    assert plan.backends == ("torchao_emulated",) * 3
    return layer_config(Linear.Config(in_features=K, out_features=N), plan, opts).build().to(dtype), plan


def run(module, x, dy):
    xg = x.clone().requires_grad_()
    y = module(xg)
    y.backward(dy)
    return y.detach(), xg.grad, module.weight.grad


def emulated(plan, x, w, dy):
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = quant_linear(xg, wg, None, LinearPlan(plan.specs))  # same specs, our emulation
    y.backward(dy)
    return y.detach(), xg.grad, wg.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "fp8_rowwise", "fp8_rowwise_hp_wgrad", "mxfp8"])
def test_torchao_module_matches_our_emulation(recipe, dtype):
    # fp32: the same casts and fp32 GEMMs (tensorwise: fp32 scale division vs multiplication, last bits).
    # bf16: our GEMMs of power-of-two-scaled casts run in bf16 (nn.gemm.gemm_dtype), torchao's
    # emulation in fp32: the same exact products, accumulated in another order, so rare last-bit flips.
    exact = recipe != "fp8_tensorwise" and dtype == torch.float32
    for seed in range(2):
        x, w, dy = operands(m=M, k=K, n=N, dtype=dtype, seed=seed)
        module, plan = torchao_layer(recipe, dtype)
        with torch.no_grad():
            module.weight.copy_(w)
        for name, a, b in zip(("y", "dx", "dw"), run(module, x, dy), emulated(plan, x, w, dy), strict=True):
            a, b = a.float(), b.float()
            if exact:
                assert torch.equal(a, b), f"{recipe} {dtype} {name}: {(a - b).abs().max()}"
            elif dtype == torch.float32:
                assert (a - b).abs().max() <= 4e-7 * b.abs().max(), f"{recipe} {name}"
            else:  # rare bf16 rounding flips: under 0.1% of elements, the difference 80 dB below the signal
                assert (a != b).float().mean() < 1e-3, f"{recipe} {name}"
                assert (a - b).norm() <= 1e-4 * b.norm(), f"{recipe} {name}"


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_float8_configs_equal_torchaos_named_recipes(name):
    from torchao.float8 import Float8LinearConfig

    ours = {
        "tensorwise": "fp8_tensorwise",
        "rowwise": "fp8_rowwise",
        "rowwise_with_gw_hp": "fp8_rowwise_hp_wgrad",
    }
    _, plan = torchao_layer(ours[name])
    got = float8_config(torchao_recipe(plan), TorchaoOptions(), emulate=True)
    assert got == dataclasses.replace(Float8LinearConfig.from_recipe_name(name), emulate=True)
    assert float8_label(got) == name


def test_mxfp8_options_reach_torchao():
    opts = TorchaoOptions(mxfp8_dim0_cast_kernel="torch", mxfp8_dim1_cast_kernel="torch")
    module, plan = torchao_layer("mxfp8", rules=[QuantRule(scale_rounding="floor")], opts=opts)
    assert isinstance(module, TorchaoMXFP8Linear)
    assert module.kernels == torchao_modules.MXFP8Kernels(True, "floor", False, "torch", "torch")
    assert module.scale_calculation_mode.value == "floor" and module.kernel_preference.name == "EMULATED"
    x, w, dy = operands(m=M, k=K, n=N)
    with torch.no_grad():
        module.weight.copy_(w)
    for a, b in zip(run(module, x, dy), emulated(plan, x, w, dy), strict=True):
        assert torch.equal(a, b)  # floor scales, torch cast kernels: still ours bit for bit
    hp, _ = torchao_layer("mxfp8", rules=[QuantRule(roles=["wgrad.*"], format="high")])
    assert hp.wgrad_with_hp


def test_fp8_all_gather_option_wraps_the_weight():
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    opts = TorchaoOptions(enable_fsdp_float8_all_gather=True)
    module, _ = torchao_layer("fp8_tensorwise", opts=opts)
    assert isinstance(module, TorchaoFloat8Linear) and module.config.enable_fsdp_float8_all_gather
    assert isinstance(module.weight.data, WeightWithDynamicFloat8CastTensor)
    plain, _ = torchao_layer("fp8_tensorwise")
    assert not isinstance(plain.weight.data, WeightWithDynamicFloat8CastTensor)


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "mxfp8"])
def test_compiled_torchao_module_equals_eager_on_cpu(recipe):
    # torchtitan's Float8 converter refuses emulate + compile; on CPU with torch 2.14.1 both compile fullgraph
    # and give the eager numbers bit for bit.
    x, w, dy = operands(m=M, k=K, n=N, seed=3)
    module, _ = torchao_layer(recipe)
    with torch.no_grad():
        module.weight.copy_(w)
    eager = run(module, x, dy)
    module.weight.grad = None
    compiled = run(torch.compile(module, fullgraph=True), x, dy)
    for a, b in zip(compiled, eager, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "mxfp8"])
def test_plain_torchao_linear_for_benchmarks_equals_ours(recipe):
    # nn.torchao_modules.torchao_linear: the same torchao module without torchtitan (benchmarks/bench_gpu.py).
    x, w, dy = operands(m=M, k=K, n=N, seed=5)
    lin = torch.nn.Linear(K, N, bias=False)
    with torch.no_grad():
        lin.weight.copy_(w)
    _, plan = torchao_layer(recipe)
    module = torchao_modules.torchao_linear(lin, plan, emulated=True)
    for a, b in zip(run(module, x, dy), emulated(plan, x, w, dy), strict=True):
        assert torch.equal(a, b)


def test_plan_and_backend_choice_import_without_torchao_or_torchtitan():
    # bench_gpu.py must run (bf16 and emulation rows) on a GPU machine that has neither.
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torchao'] = None; sys.modules['torchtitan'] = None\n"
        "from low_bits_training.nn.hardware import detect_hardware\n"
        "from low_bits_training.plan.backends import gemm_backend\n"
        "from low_bits_training.config.quantize import QuantizeConfig\n"
        "from low_bits_training.plan.resolve import LayerShape, resolve_plan\n"
        "import low_bits_training.nn.torchao_modules\n"
        "plan = resolve_plan(QuantizeConfig(recipe='mxfp8', skip=[]), {'w': LayerShape(256, 256, 256)})['w']\n"
        "print(gemm_backend(plan, 'forward'))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "emulate", p.stderr[-2000:]
