"""The quantized layers' step is capturable in a CUDA graph (issue 29): after one warm-up step (torchtitan's
CUDA-graph wrapper runs one before it captures), a forward + backward of every recipe copies nothing from the
host and reads nothing back (no ``.item()`` / ``.tolist()``), and the stochastic-rounding key lives on the
layer's device, filled in place each microbatch. Held on the meta device standing in for a GPU: every op runs
there, and a dispatch mode sees each copy between devices and each host read."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from low_bits_training.nn import LinearPlan, ProbeMode, QuantLinear, probe, rng
from low_bits_training.nn.recipes import RECIPES

DEVICE = torch.device("meta")
QUANTIZED = [r for r, specs in RECIPES.items() if any(s is not None for s in specs.values())]


class HostTraffic(TorchDispatchMode):
    """Records the ops that move data between the host and ``DEVICE`` or read a value back to Python."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        devices = {t.device.type for t in tensors} | {torch.device(kwargs.get("device") or "meta").type}
        if name == "_local_scalar_dense" or (name in ("_to_copy", "copy_") and "cpu" in devices):
            self.seen.append(f"{name} {sorted(devices)}")
        return func(*args, **kwargs)


class HostTensors(TorchFunctionMode):
    """Records tensors made from host data for ``DEVICE`` (``torch.tensor(..., device=...)`` copies its data
    over below the dispatcher, where ``HostTraffic`` does not see it) and values read back to Python."""

    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in ("tensor", "as_tensor") and torch.device(kwargs.get("device") or "cpu").type != "cpu":
            self.seen.append(f"torch.{name} on {kwargs['device']}")
        if name in ("item", "tolist"):
            self.seen.append(f"Tensor.{name}")
        return func(*args, **kwargs)


@pytest.fixture
def on_meta(monkeypatch):
    """The meta device as this process's accelerator (the step key's second copy lives there)."""
    monkeypatch.setattr(rng, "accelerator", lambda: DEVICE)
    rng.set_step_key(None)
    yield
    rng.set_step_key(None)


def _step(layer: QuantLinear, step: int) -> None:
    rng.set_step_key(1000 + step)  # the trainer, before every microbatch
    x = torch.empty(128, 128, device=DEVICE, requires_grad=True)  # (M, K): every block size divides
    layer(x).backward(torch.empty(128, 256, device=DEVICE))


@pytest.mark.parametrize("recipe", QUANTIZED)
@pytest.mark.parametrize("mode", [ProbeMode(), ProbeMode(nonfinite=True)], ids=["plain", "nonfinite"])
def test_a_warm_step_moves_nothing_between_host_and_device(recipe, mode, on_meta, monkeypatch):
    monkeypatch.setattr(probe, "_mode", [mode])
    layer = QuantLinear(128, 256, bias=False, plan=LinearPlan.from_roles(RECIPES[recipe]), device=DEVICE)
    _step(layer, 0)  # warm-up: what is made once per device (RHT signs) is made here
    with HostTraffic() as traffic, HostTensors() as made:
        _step(layer, 1)
    assert traffic.seen == [] and made.seen == []


def test_the_step_key_lives_on_the_accelerator_and_is_filled_in_place(on_meta):
    rng.set_step_key(5)
    on_device, on_host = rng.step_key_on(DEVICE), rng.step_key()
    assert on_device.device == DEVICE and on_host.device.type == "cpu" and on_host.item() == 5
    rng.set_step_key(6)
    assert rng.step_key_on(DEVICE) is on_device and rng.step_key() is on_host and on_host.item() == 6
    layer_key = torch.zeros((), dtype=torch.int64, device=DEVICE)
    with HostTraffic() as traffic:
        rng.role_key(layer_key, 3)
    assert traffic.seen == []


def test_without_an_accelerator_the_cpu_key_serves(monkeypatch):
    monkeypatch.setattr(rng, "accelerator", lambda: None)
    rng.set_step_key(7)
    try:
        assert rng.step_key_on(torch.device("cpu")) is rng.step_key()
        assert int(rng.role_key(torch.zeros((), dtype=torch.int64), 0)) == int(rng.role_key(None, 0) ^ 0)
    finally:
        rng.set_step_key(None)
