"""The quantized linear on DTensors (tensor parallelism): compute on local shards, wrap the result back.

Like torchao's float8 under TP, the quantized GEMMs see local tensors. Per mesh dim, the pair of placements
(input, weight) decides the output placement, the gradient placements and which local dims are sharded
(for scales that must reduce over a sharded dim: see ``cast.py``). ``_rule`` decides it, row by row of this
table:

============================ =========== ============ ============ ========================
input, weight                output      grad input   grad weight  sharded dims (operand: dim)
============================ =========== ============ ============ ========================
Replicate, Replicate         Replicate   Replicate    Replicate    -
Shard(token), Replicate      Shard(tok)  Shard(tok)   Partial      input 0, grad_output 0
Replicate, Shard(0) colwise  Shard(-1)   Partial      Shard(0)     weight 0, grad_output 1
Shard(-1), Shard(1) rowwise  Partial     Shard(-1)    Shard(1)     input 1, weight 1
============================ =========== ============ ============ ========================
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from .functional import quant_linear
from .probe import NO_STATE, LayerState
from .roles import LinearPlan


def _kind(p, ndim: int) -> str:
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Shard):
        if p.dim % ndim == ndim - 1:
            return "S_last"
        return "S_tok" if p.dim in (0, 1) else "S_other"
    return "other"


def _rule(px, pw, ndim: int):
    """(output, grad-input, grad-weight placements, sharded dims per operand) for one mesh dim."""
    kx, kw = _kind(px, ndim), _kind(pw, 2)
    if (kx, kw) == ("R", "R"):
        return Replicate(), Replicate(), Replicate(), {}
    if (kx, kw) == ("S_tok", "R"):
        return px, px, Partial(), {"input": 0, "grad_output": 0}
    if kx == "R" and pw == Shard(0):
        return Shard(ndim - 1), Partial(), Shard(0), {"weight": 0, "grad_output": 1}
    if kx == "S_last" and pw == Shard(1):
        return Partial(), px, Shard(1), {"input": 1, "weight": 1}
    raise NotImplementedError(
        f"QuantLinear under TP: input placement {px} with weight placement {pw} "
        "is not supported (colwise, rowwise or replicated weights only)"
    )


def dtensor_quant_linear(
    x: DTensor, weight: DTensor, bias, plan: LinearPlan, state: LayerState = NO_STATE
) -> DTensor:
    """``quant_linear`` on DTensor input and weight (same mesh), returning a DTensor.

    Tokens sharded over a mesh dim (Shard of the batch/sequence dim) count as one token dim: the 2-D view is
    (M, K) with M sharded.

    Raises:
        NotImplementedError: placements outside the table in the module docstring, or a scale that would
            need cross-shard communication the formats cannot express (see ``cast.needs_global_amax``).
        ValueError: different meshes for input and weight.
    """
    mesh = weight.device_mesh
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)
    if x.device_mesh != mesh:
        raise ValueError(f"QuantLinear: input mesh {x.device_mesh} differs from weight mesh {mesh}")
    out_p, dx_p, dw_p, shards = [], [], [], {}
    for i, (px, pw) in enumerate(zip(x.placements, weight.placements, strict=True)):
        o, gx, gw, dims = _rule(px, pw, x.ndim)
        out_p.append(o), dx_p.append(gx), dw_p.append(gw)
        for operand, d in dims.items():
            shards[operand] = (*shards.get(operand, ()), (d, mesh.get_group(i)))
    xl = x.to_local(grad_placements=dx_p)
    wl = weight.to_local(grad_placements=dw_p)
    y = DTensor.from_local(quant_linear(xl, wl, None, plan, shards, state), mesh, out_p, run_check=False)
    return y if bias is None else y + bias


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias, plan: LinearPlan, state: LayerState = NO_STATE
) -> torch.Tensor:
    """The quantized linear on plain tensors or DTensors (dispatch on the weight)."""
    if isinstance(weight, DTensor):
        return dtensor_quant_linear(x, weight, bias, plan, state)
    return quant_linear(x, weight, bias, plan, None, state)
