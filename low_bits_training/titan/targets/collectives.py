"""The low-bit collectives ``titan.targets.wire`` installs on FSDP2's units, and their byte counters.

FSDP2 (torch 2.14) lets a module replace the collective of its parameter group
(``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``): the comm object gets the flat input
buffer (this rank's shards of every parameter of the group, one after another, each padded to
``padded_sharded_param_size``) and the output buffer. ``WireAllGather`` and ``WireReduceScatter`` quantize
the payload there, segment by segment, as the sender of a low-bit wire would, and then run the ordinary
collective on the dequantized values; the result is what the receiver of the low-bit wire computes:

- all-gather (quantize before gather, ZeRO++ qwZ): each rank casts its fp32 weight shard (2-D view (rows,
  last dim), rows split across ranks; tensor scales take the all-reduced amax, ``nn.cast``), so the gathered
  weight equals ``fake_quantize`` of the full weight, stored in FSDP2's param dtype (exact in fp32, or in bf16
  with power-of-two scales; one bf16 rounding of ``q * scale`` otherwise). Gradients pass straight through.
- reduce-scatter (ZeRO++ qgZ, MS-AMP): each rank casts its contribution to every destination shard of the
  parameters FSDP2 sends in that call (one scale per parameter chunk, or blocks along it) with counter-based
  stochastic rounding keyed by (step, microbatch, rank, parameter); the chunks are summed in FSDP2's reduce
  dtype.

- torchao's fp8 all-gather (``titan.targets.wire`` switches it on where the plan's torchao layers are all
  tensorwise Float8Linear and the wire is e4m3 tensorwise): the units whose weights carry torchao's
  ``fsdp_pre_all_gather`` keep FSDP2's own all-gather, wrapped only to count its real payload
  (``CountingAllGather``).

Bytes: every call adds what this rank receives (codes + scales, ``config.comm.wire_bytes``) and what the
same collective moves in its own dtype; ``log_comm_bytes`` writes them per step into the metrics
(``comm/all_gather_bytes``, ``comm/all_gather_bytes_hp``, ``comm/reduce_scatter_bytes``, ...). See
docs/communication.md.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from low_bits_training.config.comm import wire_bytes
from low_bits_training.formats import QuantSpec, derive_key, fake_quantize
from low_bits_training.nn import rng
from low_bits_training.nn.cast import cast
from low_bits_training.titan.platform.compat import fsdp_collective_bases, fsdp_sharded_data

_KEY_MASK = (1 << 62) - 1
AllGather, ReduceScatter = fsdp_collective_bases()
BYTES: dict[str, list[int]] = {"all_gather": [0, 0], "reduce_scatter": [0, 0]}
"""Bytes this rank received since the last ``log_comm_bytes``: collective -> [low-bit wire, own dtype]."""


def _key(collective: str, fqn: str) -> torch.Tensor | None:
    """The stochastic-rounding key of one parameter's payload in this microbatch (None: no step key set)."""
    step = rng.step_key()
    if step is None:
        return None
    return torch.bitwise_xor(step, torch.tensor(derive_key(collective, fqn) & _KEY_MASK))


class _Alloc:
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class WireAllGather(_Alloc, AllGather):
    """All-gather whose payload is each parameter's shard quantized by its spec (None: as it is).

    The cast reads the fp32 sharded parameter itself, not FSDP2's copy in its param dtype, so a weight is
    rounded once: to its spec. Written into a bf16 payload, the values are exact where the scale is a power
    of two (e8m0, or ``scale_format = "e8m0"`` tensor scales); an fp32 tensor scale (amax / max) makes
    ``q * scale`` round once more to bf16 (docs/communication.md measures it).
    """

    def __init__(self, params: list[tuple[str, torch.Size, QuantSpec | None, object]]):
        self.params = params  # (fqn, padded shard size, spec, FSDPParam), in the group's flat order

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        ws, offset, hp_bytes = group.size(), 0, input_tensor.element_size()
        for fqn, size, spec, fsdp_param in self.params:
            n = size.numel()
            seg = input_tensor[offset : offset + n]
            rows = n // size[-1]
            if spec is not None:
                src = fsdp_sharded_data(fsdp_param).view(rows, size[-1])  # orig dtype (fp32)
                key = _key("all_gather", fqn) if spec.rounding == "stochastic" else None
                view = seg.view(rows, size[-1])  # shard boundaries are row boundaries of this view
                view.copy_(cast(src, spec, ((0, group),), key, f"all-gather of {fqn}"))
            amax = 4 if spec is not None and spec.scaling == "tensor" else 0  # the amax all-reduce
            BYTES["all_gather"][0] += (ws - 1) * (wire_bytes(n, rows, spec, hp_bytes) + amax)
            BYTES["all_gather"][1] += (ws - 1) * n * hp_bytes
            offset += n
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class CountingAllGather(_Alloc, AllGather):
    """All-gather left as it is, counted: torchao's Float8 weights already travel in fp8 (their
    ``fsdp_pre_all_gather``), so the payload is what goes on the wire; the high-precision count is the same
    shards in FSDP2's param dtype (torchao's separate scale all-reduce is not counted)."""

    def __init__(self, fsdp_params: list):
        self.fsdp_params = fsdp_params  # the group's FSDPParams (their dtypes are set at FSDP2's lazy init)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        ws = group.size()
        BYTES["all_gather"][0] += (ws - 1) * input_tensor.numel() * input_tensor.element_size()
        BYTES["all_gather"][1] += (ws - 1) * sum(_param_bytes(fp) for fp in self.fsdp_params)
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class WireReduceScatter(_Alloc, ReduceScatter):
    """Reduce-scatter whose every (parameter, destination rank) chunk is quantized before the sum.

    FSDP2 reduce-scatters only the parameters of the unit that got a gradient since its last call (a
    chunked loss gives [norm, lm_head] theirs at different times): each call's payload is the chunks of
    exactly those, in the unit's order (``sent_params`` finds which), and only they are cast and counted.
    """

    def __init__(self, params: list[tuple[str, int]], spec: QuantSpec):
        self.params = params  # (fqn, chunk numel), in the group's flat order
        # One scale per chunk ("tensor") or blocks along it: the chunk is a row of the (ranks, n) view.
        axis = "axis" if spec.scaling == "tensor" else spec.scaling
        self.spec = dataclasses.replace(spec, scaling=axis, axis=-1)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        ws, offset, hp_bytes = group.size(), 0, input_tensor.element_size()
        rows = input_tensor.view(ws, -1)  # row r: this rank's contribution to rank r's shard
        for fqn, n in sent_params(self.params, rows.shape[1]):
            seg = rows[:, offset : offset + n]
            key = _key("reduce_scatter", fqn) if self.spec.rounding == "stochastic" else None
            seg.copy_(fake_quantize(seg.to(torch.float32), self.spec, key))
            BYTES["reduce_scatter"][0] += (ws - 1) * wire_bytes(n, 1, self.spec, hp_bytes)
            BYTES["reduce_scatter"][1] += (ws - 1) * n * hp_bytes
            offset += n
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def sent_params(params: list[tuple[str, int]], numel: int) -> list[tuple[str, int]]:
    """The parameters whose chunks make up one reduce-scatter call of ``numel`` elements per rank.

    FSDP2 sends, in the unit's order, the parameters that got a gradient; the call's size tells which: the
    one ordered subset of ``params`` whose chunk sizes add up to ``numel``.

    Args:
        params: ``(fqn, chunk numel)`` of every parameter of the unit, in its flat order.
        numel: elements per rank in this call.

    Raises:
        RuntimeError: no subset, or two different subsets, add up to ``numel`` (the sizes cannot tell which
            parameters were sent: never seen with torchtitan's units; a bug report, not a silent guess).
    """
    found: list[list[tuple[str, int]]] = []

    def walk(i: int, left: int, chosen: list) -> None:
        if len(found) > 1:
            return
        if left == 0:
            found.append(list(chosen))
            return
        for j in range(i, len(params)):
            if params[j][1] <= left:
                walk(j + 1, left - params[j][1], [*chosen, params[j]])

    walk(0, numel, [])
    if len(found) != 1:
        sizes = ", ".join(f"{f} {n}" for f, n in params)
        what = "no" if not found else "more than one"
        raise RuntimeError(
            f"quantize.comm.reduce_scatter: {what} subset of the unit's parameters ({sizes}) adds up to "
            f"the {numel} elements FSDP2 sent; cannot tell which were sent"
        )
    return found[0]


def _param_bytes(fp) -> int:
    dtype = fp.param_dtype or fp.orig_dtype  # FSDP2's all-gather dtype without torchao's extension
    return fp.padded_sharded_param_size.numel() * dtype.itemsize


def log_comm_bytes(trainer) -> None:
    """Write this step's bytes into the metrics (on logging steps) and reset the counters."""
    got = {k: list(v) for k, v in BYTES.items() if v[1]}
    for v in BYTES.values():
        v[0] = v[1] = 0
    if not got or not trainer.metrics_processor.should_log(trainer.step):
        return
    metrics = {}
    for name, (low, hp) in got.items():
        metrics[f"comm/{name}_bytes"] = low
        metrics[f"comm/{name}_bytes_hp"] = hp
        metrics[f"comm/{name}_ratio"] = low / hp
    trainer.metrics_processor.logger.log(metrics, trainer.step)
