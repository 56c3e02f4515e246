"""``[quantize.comm]`` (config/comm.py, titan/targets/wire.py, collectives.py) against high-precision references.

- the bytes of a payload (``wire_bytes``) for known shapes, by hand;
- bad sections refused in one line;
- on 2 gloo ranks with FSDP2 (one spawn, several models): the all-gathered weight equals ``fake_quantize`` of
  the full weight (axis scales; tensor scales with a padded shard), the reduce-scattered gradient equals the
  sum of each rank's quantized contribution (nearest), stochastic rounding is unbiased against the fp32
  reduce-scatter (mean of 256 draws within 4 sigma) and each draw is within one quantum per rank of it, and
  the byte counters of one all-gather and one reduce-scatter are the exact numbers.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from helpers import free_port, leave_worker
from low_bits_training.config.comm import CommConfig, WireFormat, wire_bytes, wire_spec
from low_bits_training.errors import ConfigError
from low_bits_training.formats import QuantSpec, derive_key, fake_quantize

E4M3_AXIS = WireFormat(format="e4m3", scaling="axis")
BLOCK = 32
E4M3_BLOCK_NEAREST = WireFormat(format="e4m3", scaling="block", block_size=BLOCK, rounding="nearest")
E4M3_BLOCK_SR = WireFormat(format="e4m3", scaling="block", block_size=BLOCK, rounding="stochastic")
DRAWS = 256


# --- bytes and config, one process ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "numel, rows, spec, hp_bytes, expect",
    [
        (4096, 64, None, 2, 8192),  # high precision: bf16
        (4096, 64, QuantSpec("e4m3", "tensor"), 2, 4096 + 4),  # codes + one fp32 scale
        (4096, 64, QuantSpec("e4m3", "axis"), 4, 4096 + 64 * 4),  # one fp32 scale per row
        (4096, 64, QuantSpec("e4m3", "block", block_size=32, scale_format="e8m0"), 4, 4096 + 128),
        (
            4096,
            64,
            QuantSpec("e2m1", "block", block_size=16, scale_format="ue4m3"),
            4,
            2048 + 256,
        ),  # 2 codes/byte
        (4096, 64, QuantSpec("int8", "tile", block_size=16, scale_format="bf16"), 4, 4096 + 16 * 2),
        (4095, 1, QuantSpec("e2m1", "tensor"), 4, 2048 + 4),  # an odd count rounds up to a whole byte
    ],
    ids=["high", "tensor", "axis", "mx-block", "fp4-block", "int8-tile", "odd-fp4"],
)
def test_wire_bytes_by_hand(numel, rows, spec, hp_bytes, expect):
    assert wire_bytes(numel, rows, spec, hp_bytes) == expect


def test_wire_spec_maps_the_section_and_high_is_none():
    assert wire_spec(WireFormat(), "all_gather") is None
    spec = wire_spec(E4M3_BLOCK_SR, "reduce_scatter")
    assert spec == QuantSpec("e4m3", "block", block_size=BLOCK, rounding="stochastic")


@pytest.mark.parametrize(
    "wire, collective, expect",
    [
        (WireFormat(format="e9m9"), "all_gather", "quantize.comm.all_gather: unknown format 'e9m9'"),
        (
            WireFormat(format="e4m3", scaling="axis"),
            "reduce_scatter",
            "quantize.comm.reduce_scatter.scaling = 'axis'",
        ),
        (
            WireFormat(format="e4m3", scaling="rows"),
            "all_gather",
            "quantize.comm.all_gather.scaling = 'rows'",
        ),
        (WireFormat(format="e4m3", rounding="up"), "all_gather", "quantize.comm.all_gather.rounding='up'"),
    ],
    ids=["format", "rs-axis", "ag-scaling", "rounding"],
)
def test_bad_sections_are_one_line(wire, collective, expect):
    with pytest.raises(ConfigError) as e:
        wire_spec(wire, collective)
    assert str(e.value).startswith(expect) and "\n" not in str(e.value), str(e.value)


# --- 2 gloo ranks, FSDP2 --------------------------------------------------------------------------------------

IN, HID, OUT, ODD = 64, 96, 32, 33  # Linear(IN, HID), Linear(HID, OUT); ODD rows pad rank 1's shard


def _model(rows: int = HID) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, rows, bias=False), nn.Linear(rows, OUT, bias=False))


def _shard(model: nn.Sequential, cfg: CommConfig, param_dtype: torch.dtype | None = None) -> nn.Sequential:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from low_bits_training.titan.platform.cpu import force_sum_reductions
    from low_bits_training.titan.targets import wire

    mesh = init_device_mesh("cpu", (2,))
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    for layer in model:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    for m in model.modules():  # as torchtitan (divide factor 1) on gloo (plain SUM): gradients are summed
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
    force_sum_reductions(model)
    assert wire.install(model, cfg) == 2
    return model


def _gathered(cfg: CommConfig, rows: int, param_dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The weights each layer's forward sees after the (quantized) all-gather."""
    model = _model(rows)
    seen = {}
    for i, layer in enumerate(model):
        layer.register_forward_pre_hook(
            lambda m, a, i=i: seen.__setitem__(f"{i}.weight", m.weight.detach().clone())
        )
    _shard(model, cfg, param_dtype)(torch.randn(4, IN, dtype=param_dtype or torch.float32))
    return seen


def _data(rank: int) -> torch.Tensor:
    return torch.randn(8, IN, generator=torch.Generator().manual_seed(100 + rank))


def _local_grads(rank: int) -> dict[str, torch.Tensor]:
    """This rank's own full gradient (no FSDP): its contribution to the reduce-scatter."""
    model = _model()
    model(_data(rank)).square().sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _sharded_grads(cfg: CommConfig, rank: int, draws: int = 1) -> list[dict[str, torch.Tensor]]:
    """This rank's gradient shards after the FSDP2 reduce-scatter, one dict per draw (a new SR key each)."""
    from low_bits_training.nn import rng

    model, out = _shard(_model(), cfg), []
    for draw in range(draws):
        rng.set_step_key(derive_key("draw", draw, rank))  # the trainer sets this per microbatch
        model.zero_grad()
        model(_data(rank)).square().sum().backward()
        out.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
    rng.set_step_key(None)
    return out


def _counted(cfg: CommConfig) -> dict[str, list[int]]:
    """The byte counters after exactly one all-gather of layer 0 and one reduce-scatter of both layers."""
    from low_bits_training.titan.targets import collectives

    model = _shard(_model(), cfg)
    for v in collectives.BYTES.values():
        v[0] = v[1] = 0
    model[0].unshard()
    out = {"all_gather": list(collectives.BYTES["all_gather"])}
    model[0].reshard()
    model(_data(0)).sum().backward()
    out["reduce_scatter"] = list(collectives.BYTES["reduce_scatter"])
    return out


class _TwoInOneUnit(nn.Module):
    """One FSDP2 unit with two weights; the forward uses the second only (as a chunked loss leaves some of a
    unit's parameters without a gradient in one backward): FSDP2 reduce-scatters that one alone."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.a = nn.Linear(IN, HID, bias=False)  # no gradient
        self.b = nn.Linear(IN, OUT, bias=False)

    def forward(self, x):
        return self.b(x)


PARTIAL_WIRE = WireFormat(format="e4m3", scaling="tensor", rounding="nearest")


def _partial(rank: int) -> dict:
    """The b gradient after a reduce-scatter of the partial unit, this rank's own b gradient, the counters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from low_bits_training.titan.platform.cpu import force_sum_reductions
    from low_bits_training.titan.targets import collectives, wire

    local = _TwoInOneUnit()
    local(_data(rank)).square().sum().backward()
    model = _TwoInOneUnit()
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    model.set_gradient_divide_factor(1.0)
    force_sum_reductions(model)
    wire.install(model, CommConfig(reduce_scatter=PARTIAL_WIRE))
    for v in collectives.BYTES.values():
        v[0] = v[1] = 0
    model(_data(rank)).square().sum().backward()
    assert model.a.weight.grad is None
    return {
        "grad": model.b.weight.grad.to_local().clone(),
        "local": local.b.weight.grad,
        "bytes": {k: list(v) for k, v in collectives.BYTES.items()},
    }


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    all_gather_only = dict(all_gather_params=["*"], reduce_scatter=WireFormat())
    results = {
        "axis": _gathered(CommConfig(all_gather=E4M3_AXIS, **all_gather_only), HID),
        "tensor_padded": _gathered(
            CommConfig(all_gather=WireFormat(format="e4m3", scaling="tensor"), **all_gather_only), ODD
        ),
        "tensor_bf16": _gathered(
            CommConfig(all_gather=WireFormat(format="e4m3", scaling="tensor"), **all_gather_only),
            HID,
            torch.bfloat16,
        ),
        "local": _local_grads(rank),
        "nearest": _sharded_grads(CommConfig(reduce_scatter=E4M3_BLOCK_NEAREST), rank)[0],
        "high": _sharded_grads(CommConfig(reduce_scatter=WireFormat()), rank)[0],
        "sr": _sharded_grads(CommConfig(reduce_scatter=E4M3_BLOCK_SR), rank, DRAWS),
        "bytes": _counted(
            CommConfig(all_gather=E4M3_AXIS, all_gather_params=["*"], reduce_scatter=E4M3_BLOCK_SR)
        ),
        "partial": _partial(rank),
    }
    torch.save(results, f"{out}.{rank}")
    leave_worker()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = str(tmp_path_factory.mktemp("comm") / "r")
    mp.start_processes(_worker, args=(free_port(), out), nprocs=2, join=True, start_method="spawn")
    return [torch.load(f"{out}.{r}") for r in range(2)]


def _full(rows: int = HID) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in _model(rows).named_parameters()}


@pytest.mark.parametrize("case, rows, spec", [("axis", HID, "axis"), ("tensor_padded", ODD, "tensor")])
def test_all_gathered_weight_is_fake_quantize_of_the_full_weight(two_ranks, case, rows, spec):
    for rank in range(2):
        for name, w in _full(rows).items():
            expect = fake_quantize(w, QuantSpec("e4m3", spec))
            assert not torch.equal(expect, w)  # the format changed something
            torch.testing.assert_close(two_ranks[rank][case][name], expect, rtol=0, atol=0)


@pytest.mark.slow
def test_all_gather_in_bf16_casts_the_fp32_weight_once(two_ranks):
    # bf16 param dtype (torchtitan's default): the gathered weight is the fp32 weight's cast, stored in bf16
    # (one rounding of q * scale), not the cast of FSDP2's bf16 copy (fp32 -> bf16 -> e4m3).
    for rank in range(2):
        for name, w in _full().items():
            once = fake_quantize(w, QuantSpec("e4m3", "tensor")).to(torch.bfloat16)
            twice = fake_quantize(w.to(torch.bfloat16).float(), QuantSpec("e4m3", "tensor")).to(
                torch.bfloat16
            )
            got = two_ranks[rank]["tensor_bf16"][name]
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got, once, rtol=0, atol=0)
            assert (twice != once).float().mean() > 0.005  # the double rounding this avoids changes codes


def _shard_of(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t.chunk(2, dim=0)[rank]  # FSDP2 shards dim 0; both dims here are even


def _blocks_quantized(g: torch.Tensor, rank: int) -> torch.Tensor:
    """fake_quantize of one destination chunk in BLOCK-long rows, one scale each (the spec by other means)."""
    chunk = _shard_of(g, rank)
    return fake_quantize(chunk.reshape(-1, BLOCK), QuantSpec("e4m3", "axis")).reshape(chunk.shape)


def test_reduce_scatter_nearest_is_the_sum_of_quantized_contributions(two_ranks):
    for rank in range(2):
        for name in two_ranks[0]["local"]:
            contributions = [_blocks_quantized(two_ranks[src]["local"][name], rank) for src in range(2)]
            torch.testing.assert_close(two_ranks[rank]["nearest"][name], sum(contributions), rtol=0, atol=0)
            exact = sum(_shard_of(two_ranks[src]["local"][name], rank) for src in range(2))
            torch.testing.assert_close(two_ranks[rank]["high"][name], exact, rtol=1e-6, atol=1e-6)


def _quantum(g: torch.Tensor, rank: int) -> torch.Tensor:
    """The spacing of e4m3 codes around each element of a chunk, upper bound: 2^-3 of its block's scale * 2^8."""
    chunk = _shard_of(g, rank).reshape(-1, BLOCK)
    amax = chunk.abs().amax(dim=1, keepdim=True)
    return (amax / 448 * 2.0 ** (8 - 3)).expand_as(chunk).reshape(_shard_of(g, rank).shape)


def test_reduce_scatter_stochastic_is_unbiased_and_bounded(two_ranks):
    for rank in range(2):
        for name in two_ranks[0]["local"]:
            exact = sum(_shard_of(two_ranks[src]["local"][name], rank) for src in range(2))
            draws = torch.stack([d[name] for d in two_ranks[rank]["sr"]])  # (DRAWS, *shard)
            bound = sum(_quantum(two_ranks[src]["local"][name], rank) for src in range(2))
            assert (
                (draws - exact).abs() <= bound * 1.001 + 1e-6
            ).all()  # each draw: within one quantum per rank
            assert (draws[0] != draws[1]).any()  # new key, new bits
            # Unbiased: the mean of DRAWS independent draws is within 4 sigma of the fp32 sum, per element.
            sigma = draws.std(dim=0) / DRAWS**0.5
            z = (draws.mean(dim=0) - exact).abs() / sigma.clamp_min(1e-30)
            assert (z[sigma > 0] < 4.5).float().mean() > 0.999, z.max()
            # ... and on the whole tensor, the bias is far below one draw's error
            assert (draws.mean(dim=0) - exact).norm() < 0.2 * (draws[0] - exact).norm()


def test_byte_counters_are_exact(two_ranks):
    # Layer 0: weight (96, 64) fp32, shard (48, 64). One all-gather receives the other rank's shard: e4m3
    # codes (1 byte each) + one fp32 scale per row.
    assert two_ranks[0]["bytes"]["all_gather"] == [48 * 64 + 48 * 4, 48 * 64 * 4]
    # One backward: one reduce-scatter per layer; each rank receives the other's contribution to its shard:
    # layer 0 (48 x 64) and layer 1 (16 x 96), codes + one fp32 scale per 32-element block.
    shards = [48 * 64, 16 * 96]
    low = sum(n + n // BLOCK * 4 for n in shards)
    for rank in range(2):
        assert two_ranks[rank]["bytes"]["reduce_scatter"] == [low, sum(shards) * 4]


def test_reduce_scatter_of_a_partial_unit_casts_and_counts_what_is_sent(two_ranks):
    # Only b (OUT x IN) got a gradient: each destination chunk of b has one tensor scale of its own, the sum
    # is of those casts, and the counters hold b's chunk alone (codes + one fp32 scale), not a's.
    for rank in range(2):
        chunks = [_shard_of(two_ranks[src]["partial"]["local"], rank) for src in range(2)]
        expect = sum(fake_quantize(c, QuantSpec("e4m3", "tensor")) for c in chunks)
        torch.testing.assert_close(two_ranks[rank]["partial"]["grad"], expect, rtol=0, atol=0)
        n = OUT * IN // 2
        assert two_ranks[rank]["partial"]["bytes"]["reduce_scatter"] == [n + 4, n * 4]


def test_sent_params_finds_the_one_subset_and_refuses_a_guess():
    from low_bits_training.titan.targets.collectives import sent_params

    params = [("a", 6), ("b", 4), ("c", 2)]
    assert sent_params(params, 12) == params
    assert sent_params(params, 4) == [("b", 4)]
    assert sent_params(params, 8) == [("a", 6), ("c", 2)]
    with pytest.raises(RuntimeError, match="more than one subset"):
        sent_params(params, 6)  # a alone, or b + c
    with pytest.raises(RuntimeError, match="no subset"):
        sent_params(params, 5)
