"""The trainer's amax group for delayed scaling (titan/targets/delayed.py): the data ranks' group when a layer
keeps an amax history, nothing (no collective) otherwise. The all-reduce itself: tests/nn/test_delayed.py."""

from types import SimpleNamespace

import torch

from low_bits_training.formats import QuantSpec
from low_bits_training.nn import LinearPlan, QuantLinear, delayed
from low_bits_training.nn.roles import ROLES
from low_bits_training.titan.targets.delayed import install


class _Mesh:
    def get_group(self):
        return "loss-group"


def _trainer(spec, mesh):
    layer = QuantLinear(32, 32, plan=LinearPlan.from_roles({r.name: spec for r in ROLES}))
    dims = SimpleNamespace(get_optional_mesh=lambda name: mesh if name == "loss" else None)
    return SimpleNamespace(model_parts=[torch.nn.Sequential(layer)], parallel_dims=dims)


def test_amax_group_is_the_data_ranks_only_with_a_history():
    try:
        delayed_spec = QuantSpec.fp8_tensorwise(amax_history=8)
        assert install(_trainer(delayed_spec, _Mesh())) == "loss-group" == delayed.amax_group()
        assert install(_trainer(delayed_spec, None)) is None is delayed.amax_group()  # one data rank
        assert install(_trainer(QuantSpec.fp8_tensorwise(), _Mesh())) is None is delayed.amax_group()
    finally:
        delayed.set_amax_group(None)
