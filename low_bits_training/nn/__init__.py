"""Quantized matmul and QuantLinear: the three GEMMs of a linear layer cast by a per-operand plan."""

from .cast import cast, scaled_values
from .functional import GEMM_OPERANDS, QuantMatmul, quant_linear, run_gemm
from .kernels import device_has_fp8_gemm, unsupported_reason
from .linear import STATE_BUFFERS, QuantLinear
from .probe import FLAG_SLOTS, LayerState, ProbeMode
from .roles import GEMMS, ROLE_NAMES, ROLES, LinearPlan, Role
from .tp import linear

__all__ = [
    "FLAG_SLOTS",
    "GEMMS",
    "GEMM_OPERANDS",
    "ROLES",
    "ROLE_NAMES",
    "STATE_BUFFERS",
    "LayerState",
    "LinearPlan",
    "ProbeMode",
    "QuantLinear",
    "QuantMatmul",
    "Role",
    "cast",
    "device_has_fp8_gemm",
    "linear",
    "quant_linear",
    "run_gemm",
    "scaled_values",
    "unsupported_reason",
]
