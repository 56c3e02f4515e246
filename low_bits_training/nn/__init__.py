"""Quantized matmul and QuantLinear: the three GEMMs of a linear layer cast by a per-operand plan.

The public surface: a plan (``LinearPlan``, its roles and GEMMs; ``LinearPlan.from_recipe``), the layer
(``QuantLinear``) and its functional (``quant_linear``; ``linear`` also takes DTensors), and what the in-graph
probes record (``ProbeMode``). The rest (the autograd function, casts, kernels, probe slots) is reached
through its own module (``nn.functional``, ``nn.gemm``, ``nn.cast``, ``nn.kernels``, ``nn.probe``, ``nn.linear``).
See docs/nn.md.
"""

from .functional import quant_linear
from .gemm import GEMM_OPERANDS
from .linear import QuantLinear
from .probe import ProbeMode
from .roles import GEMMS, ROLE_NAMES, ROLES, LinearPlan, Role
from .tp import linear

__all__ = [
    "GEMMS",
    "GEMM_OPERANDS",
    "ROLES",
    "ROLE_NAMES",
    "LinearPlan",
    "ProbeMode",
    "QuantLinear",
    "Role",
    "linear",
    "quant_linear",
]
