"""Delayed scaling under activation checkpointing: each amax is recorded once per forward, and the recompute
reads the history as the first pass did, so checkpointed training equals training without, bit for bit
(torchtitan's own full and selective AC policies, eager and compiled; nn/delayed.py "When the forward
records"). Every recipe under both policies: the last test. Through the launcher (the 1B / 8B presets' selective
AC, eager and compiled): tests/titan/runtime/test_ac_train.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from low_bits_training.formats import QuantSpec
from low_bits_training.nn import ROLE_NAMES, LinearPlan, QuantLinear
from low_bits_training.nn.recipes import RECIPES


def _plan() -> LinearPlan:
    spec = QuantSpec.fp8_tensorwise(amax_history=4)
    grad = QuantSpec.fp8_tensorwise("e5m2", amax_history=4, amax_compute="most_recent")
    return LinearPlan.from_roles({r: grad if "grad_output" in r else spec for r in ROLE_NAMES})


WIDTH = 32


class _Block(nn.Module):
    def __init__(self, seed: int, plan: LinearPlan | None = None, width: int = WIDTH):
        super().__init__()
        self.a = QuantLinear(width, width, bias=False, plan=plan or _plan())
        self.b = QuantLinear(width, width, bias=False, plan=plan or _plan())
        g = torch.Generator().manual_seed(seed)
        for lin in (self.a, self.b):
            nn.init.normal_(lin.weight, std=0.2, generator=g)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))  # b's backward needs a's output: recomputed under AC


class _Model(nn.Module):
    """torchtitan's shape: ``layers`` of blocks (what its AC policies wrap)."""

    def __init__(self, plan: LinearPlan | None = None, width: int = WIDTH):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): _Block(i, plan, width) for i in range(2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.layers.values():
            x = block(x)
        return x


class _Reentrant(nn.Module):
    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=True)


def _model(ac: str, compiled: bool = False, plan: LinearPlan | None = None, width: int = WIDTH) -> _Model:
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    torch.manual_seed(0)
    model = _Model(plan, width)
    if ac == "full":
        FullAC(FullAC.Config()).apply(model)
    elif ac == "selective":
        SelectiveAC(SelectiveAC.Config()).apply(model)
    elif ac == "reentrant":
        for name, block in list(model.layers.items()):
            model.layers[name] = _Reentrant(block)
    if compiled:  # as torchtitan compiles: each block (its checkpoint inside), fullgraph
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        for block in model.layers.values():
            block.compile(fullgraph=True)
    return model


def _histories(model: nn.Module) -> list[torch.Tensor]:
    return [b.clone() for n, b in model.named_buffers() if n.endswith("lbt_amax_history")]


def _train(
    model: nn.Module, steps: int = 4, microbatches: int = 1, width: int = WIDTH
) -> list[list[torch.Tensor]]:
    """Per step: the outputs, every gradient and every amax history (after the step)."""
    out = []
    for s in range(steps):
        ys = []
        for m in range(microbatches):  # gradient accumulation: forward + backward per microbatch
            g = torch.Generator().manual_seed(100 * s + m)
            x = (torch.randn(16 if width == WIDTH else width, width, generator=g) * (1 + s)).requires_grad_(
                True
            )
            y = model(x)
            y.pow(2).sum().backward()
            ys += [y.detach(), x.grad]
        out.append([*ys, *(p.grad.clone() for p in model.parameters()), *_histories(model)])
        for p in model.parameters():
            p.grad = None
    return out


def _assert_equal(a, b) -> None:
    for step, (u, v) in enumerate(zip(a, b, strict=True)):
        for i, (p, q) in enumerate(zip(u, v, strict=True)):
            assert torch.equal(p, q), f"step {step}, tensor {i}: max diff {(p - q).abs().max()}"


def test_the_forward_reads_the_history_and_its_backward_records_once():
    layer = QuantLinear(32, 32, bias=False, plan=_plan())
    x = torch.randn(8, 32, requires_grad=True)
    y = layer(x)
    assert layer.lbt_amax_history.abs().sum() == 0  # nothing recorded by the forward
    y.backward(torch.randn(8, 32))
    h = layer.lbt_amax_history
    assert (h[:, 0] > 0).all() and (h[:, 1:] == 0).all()  # each of the six roles recorded one entry
    assert h[0, 0] == x.abs().max() and h[1, 0] == layer.weight.abs().max()


@pytest.mark.parametrize("ac", ["full", "selective", "reentrant"])
def test_checkpointed_training_equals_training_without(ac):
    ref = _train(_model("none"))
    _assert_equal(_train(_model(ac)), ref)
    assert any(h[0, 2] > 0 for h in ref[-1][-4:])  # the histories had filled (the scales came from them)


def test_checkpointed_gradient_accumulation_equals_training_without():
    _assert_equal(_train(_model("full"), steps=3, microbatches=2), _train(_model("none"), 3, 2))


@pytest.mark.parametrize("ac", ["full", "selective"])
def test_compiled_checkpointed_training_equals_training_without(ac, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    ref = _train(_model("none", compiled=True), steps=3)
    _assert_equal(_train(_model(ac, compiled=True), steps=3), ref)
    _assert_equal(_train(_model("none"), steps=3), ref)  # and compiled equals eager


@pytest.mark.parametrize("ac", ["full", "selective"])
@pytest.mark.parametrize("recipe", sorted(r for r in RECIPES if r != "bf16"))
def test_every_recipe_checkpointed_equals_training_without(recipe, ac):
    """Each recipe's plan on both layers (128 wide: deepseek_fp8's 128-blocks fit), torchtitan's policy."""
    plan = LinearPlan.from_recipe(recipe)
    ref = _train(_model("none", plan=plan, width=128), steps=3, width=128)
    _assert_equal(_train(_model(ac, plan=plan, width=128), steps=3, width=128), ref)
