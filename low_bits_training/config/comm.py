"""``[quantize.comm]``: the number formats on the wire of FSDP2's collectives (pure config, no torch.distributed).

Two collectives carry the model's bytes under data parallelism: the weight all-gather before each FSDP
unit's forward (and backward, when resharded) and the gradient reduce-scatter after its backward. Each can
be put in a low-bit format: the sender quantizes its shard (codes + scales), the receiver dequantizes.
``titan/targets/wire.py`` runs it (emulated on any backend) and counts the bytes.

    [quantize.comm.all_gather]      # ZeRO++ qwZ / torchao fp8 all-gather
    format = "e4m3"
    scaling = "axis"                # one scale per weight row (rows never straddle two shards)

    [quantize.comm.reduce_scatter]  # ZeRO++ qgZ / MS-AMP fp8 gradients
    format = "e4m3"
    scaling = "block"
    block_size = 128
    rounding = "stochastic"         # the default here: unbiased sums
"""

from __future__ import annotations

from dataclasses import dataclass, field

from low_bits_training.config.section import checked_spec
from low_bits_training.errors import ConfigError
from low_bits_training.formats import HIGH, QuantSpec, get_format
from low_bits_training.formats.spec import spec_kwargs

SCALINGS = {"all_gather": ("tensor", "axis", "block", "tile"), "reduce_scatter": ("tensor", "block")}
"""Scalings each collective allows. All-gather: of the weight viewed as (rows, last dim), sharded by rows
(axis / block run along the last dim; tile and tensor need no more than the shard and one amax). Reduce-
scatter: of each parameter's flat per-rank chunk (tensor: one scale per chunk)."""


@dataclass(kw_only=True, slots=True)
class WireFormat:
    """The format of one collective's payload (fields as in ``QuantSpec``, passed to it by name:
    ``formats.spec.spec_kwargs``)."""

    format: str = HIGH
    """Element format (``e4m3``, ``e5m2``, ``int8``, ``e2m1``, ...) or "high": the collective's own dtype
    (FSDP2's param dtype for the all-gather, its reduce dtype for the reduce-scatter)."""
    scaling: str = "tensor"
    """How scales are grouped; see ``SCALINGS`` for what each collective allows."""
    block_size: int = 128
    """Block length (block) or tile side (tile); it must divide each parameter's shard."""
    scale_format: str = "fp32"
    """fp32 | bf16 | e8m0 | ue4m3: the scales' own wire format."""
    scale_rounding: str = "exact"
    """exact | floor | ceil | rceil (see ``QuantSpec.scale_rounding``)."""
    rounding: str = "nearest"
    """nearest | stochastic | toward_zero. Stochastic bits are counter-based: keyed by (step, microbatch,
    rank, parameter), the same eager, compiled and after a resume."""


@dataclass(kw_only=True, slots=True)
class CommConfig:
    """``[quantize.comm]``: low-bit FSDP2 collectives (emulated; bytes per step in the metrics)."""

    all_gather: WireFormat = field(default_factory=WireFormat)
    """``[quantize.comm.all_gather]``: the weight all-gather (quantize-before-gather)."""
    all_gather_params: list[str] = field(default_factory=lambda: ["layers.*"])
    """FQN globs of the parameters (2-D and larger) whose all-gather is low-bit; the rest (embeddings,
    output projection, norms) gather in the param dtype."""
    reduce_scatter: WireFormat = field(default_factory=lambda: WireFormat(rounding="stochastic"))
    """``[quantize.comm.reduce_scatter]``: the gradient reduce-scatter (each rank quantizes its
    contribution to every shard; the sums are taken in the reduce dtype)."""


def wire_spec(wire: WireFormat, collective: str) -> QuantSpec | None:
    """The ``QuantSpec`` of a collective's payload (None: high precision).

    Args:
        wire: the section.
        collective: "all_gather" | "reduce_scatter".

    Raises:
        ConfigError: one line naming ``quantize.comm.<collective>.<key>``, the value and what is allowed.
    """
    where = f"quantize.comm.{collective}"
    if wire.format == HIGH:
        return None
    if wire.scaling not in SCALINGS[collective]:
        allowed = ", ".join(SCALINGS[collective])
        raise ConfigError(f"{where}.scaling = {wire.scaling!r}: expected one of {allowed}")
    return checked_spec(where, wire.format, **spec_kwargs(wire))


def check_shard_degree(cfg: CommConfig, dp_shard: int) -> None:
    """``[quantize.comm]`` needs FSDP2's collectives: data-parallel sharding over more than one rank.

    Args:
        cfg: the section.
        dp_shard: ``data_parallel_shard_degree`` once -1 is filled in from the process count.

    Raises:
        ConfigError: a low-bit format is asked for and FSDP2 shards nothing (one rank, or DDP / TP / PP only).
    """
    asked = [c for c in ("all_gather", "reduce_scatter") if getattr(cfg, c).format != HIGH]
    if asked and dp_shard <= 1:
        raise ConfigError(
            f"quantize.comm.{asked[0]}.format = {getattr(cfg, asked[0]).format!r}: "
            f"parallelism.data_parallel_shard_degree = {dp_shard}, so FSDP2 shards nothing and there is no "
            "all-gather / reduce-scatter to carry it; allowed: data_parallel_shard_degree > 1, or 'high'"
        )


def wire_bytes(numel: int, rows: int, spec: QuantSpec | None, hp_bytes: int) -> int:
    """Bytes one quantized payload of ``numel`` elements in ``rows`` rows takes on the wire.

    Codes as ``formats.pack`` stores them (two per byte for formats of <= 4 bits, else one per byte) plus
    one whole-byte scale per group in ``spec.scale_format`` (groups: 1 for tensor, ``rows`` for axis,
    ``numel / block`` for block, ``numel / block^2`` for tile). High precision (``spec`` None):
    ``numel * hp_bytes``.
    """

    if spec is None:
        return numel * hp_bytes
    groups = {
        "tensor": 1,
        "axis": rows,
        "block": numel // spec.block_size,
        "tile": numel // spec.block_size**2,
    }
    codes = -(-numel // 2) if spec.elem.bits <= 4 else numel
    return codes + groups[spec.scaling] * -(-get_format(spec.scale_format).bits // 8)
