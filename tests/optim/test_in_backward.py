"""``in_backward``: each parameter updated by a hook in the backward, its gradient freed there, equals the
update of ``step()`` after the whole backward bit for bit (stochastic rounding included), and no more than one
parameter's gradient is alive after its hook."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from low_bits_training.optim import LowBitAdamW


def _model(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.LayerNorm(64)).to(dtype)


def _opt(model: nn.Module, in_backward: bool, **kw) -> LowBitAdamW:
    names, params = zip(*model.named_parameters(), strict=True)
    group = {"params": list(params), "param_names": list(names)}
    return LowBitAdamW(
        [group], lr=1e-2, weight_decay=0.1, min_quantized_numel=0, in_backward=in_backward, **kw
    )


def _loss(model: nn.Module, k: int) -> torch.Tensor:
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(k)).to(next(model.parameters()).dtype)
    return model(x).float().pow(2).mean()


@pytest.mark.parametrize(
    ("dtype", "kw"),
    [
        (torch.float32, {}),
        (
            torch.bfloat16,
            {"master_weights": "bf16", "master_rounding": "stochastic", "exp_avg": "int4_block128"},
        ),
        (torch.float32, {"fused": False}),
    ],
    ids=["fp32-fused", "bf16-sr-fused", "fp32-eager"],
)
def test_the_update_in_the_backward_equals_step(dtype, kw):
    ref, mine = _model(dtype), _model(dtype)
    o_ref, o = _opt(ref, False, **kw), _opt(mine, True, **kw)
    for k in range(3):
        o_ref.zero_grad()
        _loss(ref, k).backward()
        o_ref.step()
        o.zero_grad()
        _loss(mine, k).backward()
        assert all(p.grad is None for p in mine.parameters())  # each freed by its hook
        o.step()  # nothing left to do
    for (name, a), b in zip(ref.named_parameters(), mine.parameters(), strict=True):
        assert torch.equal(a, b), name
        assert not torch.equal(a, _model(dtype).get_parameter(name)), name  # it moved
    for p, q in zip(ref.parameters(), mine.parameters(), strict=True):
        for key, v in o_ref.state[p].items():
            assert torch.equal(v, o.state[q][key]), key


def test_at_most_one_gradient_lives_after_each_hook():
    model = _model(torch.float32)
    o = _opt(model, True)
    alive: list[int] = []

    def count(_):  # runs after the optimizer's hook of the same parameter (hooks run in registration order)
        alive.append(sum(p.grad is not None for p in model.parameters()))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(count)
    _loss(model, 0).backward()
    assert len(alive) == 6 and max(alive) == 0, alive
    assert int(o.state[model[0].weight]["step"]) == 1


def test_a_bad_value_is_one_line():
    with pytest.raises(ValueError, match=r"^in_backward='yes': allowed true, false$"):
        _opt(_model(torch.float32), "yes")
