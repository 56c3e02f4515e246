"""Host snapshots (titan/runtime/autopilot/snapshot.py): a restored state trains on bit for bit as the state it was
taken from, with the model's tensors written in place, for AdamW and for a low-bit optimizer state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from low_bits_training.titan.runtime.autopilot.snapshot import restore, take


class _Trainer(SimpleNamespace):
    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state):
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def _trainer(optimizer: str) -> _Trainer:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    model.register_buffer("history", torch.zeros(4))  # like a delayed-scaling amax history
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:  # int8 first moment, e4m3 sqrt(second moment), 128-blocks: states stored in their own formats
        from low_bits_training.optim import LowBitAdamW

        opt = LowBitAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return _Trainer(
        model_parts=[model],
        optimizers=SimpleNamespace(optimizers=[opt]),
        lr_schedulers=SimpleNamespace(schedulers=[sched]),
        step=0,
        ntokens_seen=0,
    )


def _train(t: _Trainer, steps: int) -> list[float]:
    model, (opt,), (sched,) = t.model_parts[0], t.optimizers.optimizers, t.lr_schedulers.schedulers
    losses = []
    for _ in range(steps):
        t.step += 1
        g = torch.Generator().manual_seed(t.step)  # the batch of a step, as the recorded batches are
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            model.history.copy_(torch.roll(model.history, 1))
            model.history[0] = loss.detach()
        t.ntokens_seen += 16
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("optimizer", ["adamw", "lowbit_adamw"])
def test_a_restored_snapshot_trains_on_bit_for_bit(optimizer):
    t = _trainer(optimizer)
    _train(t, 2)
    snap = take(t, t.step)
    first = _train(t, 3)
    after = [p.detach().clone() for p in t.model_parts[0].parameters()]
    weights = [p for p in t.model_parts[0].parameters()]
    restore(t, snap)
    assert (t.step, t.ntokens_seen) == (2, 32)
    assert t.optimizers.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 / 3)
    again = _train(t, 3)
    assert again == first  # bit for bit: the same floats
    assert all(torch.equal(a, p) for a, p in zip(after, t.model_parts[0].parameters(), strict=True))
    assert all(a is b for a, b in zip(weights, t.model_parts[0].parameters(), strict=True))  # in place
    assert snap.nbytes > 0 and snap.seconds >= 0


def test_a_snapshot_is_a_copy_not_a_view():
    t = _trainer("adamw")
    _train(t, 1)
    snap = take(t, t.step)
    w = t.model_parts[0][0].weight
    before = w.detach().clone()
    _train(t, 1)
    assert not torch.equal(w, before)
    restore(t, snap)
    assert torch.equal(w, before)
