"""``[quantize.comm]`` in torchtitan: FSDP2's weight all-gather and gradient reduce-scatter in low-bit formats.

This module checks the section against the parallelism, wraps the model spec's ``parallelize_fn`` so that
every FSDP2 unit gets the collectives of ``titan.targets.collectives`` (which quantize the payload and count
the bytes; see there and docs/communication.md), and switches torchao's own fp8 all-gather on where the plan's
torchao layers are all tensorwise Float8Linear and the wire is e4m3 tensorwise.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools

import torch
from torch.distributed.fsdp import FSDPModule

from low_bits_training.config.comm import CommConfig, wire_spec
from low_bits_training.errors import ConfigError
from low_bits_training.formats import QuantSpec
from low_bits_training.nn.state import clean_fqn
from low_bits_training.nn.torchao_recipes import torchao_recipe
from low_bits_training.titan.platform.compat import fsdp_param_groups, fsdp_sharded_local
from low_bits_training.titan.targets.collectives import CountingAllGather, WireAllGather, WireReduceScatter
from low_bits_training.titan.targets.kind import TargetKind


def _groups(model: torch.nn.Module):
    """``(module, fsdp param group, [(fqn, FSDPParam)])`` of every FSDP2 unit with parameters."""
    names = {id(p): clean_fqn(n) for n, p in model.named_parameters()}
    for mod in model.modules():
        if not isinstance(mod, FSDPModule):
            continue
        for pg in fsdp_param_groups(mod):
            yield mod, pg, [(names.get(id(fp.sharded_param), "?"), fp) for fp in pg.fsdp_params]


def _check_fits(fqn: str, numel: int, spec: QuantSpec | None, collective: str, what: str) -> None:
    if spec is not None and spec.scaling in ("block", "tile") and numel % spec.block_size:
        raise ConfigError(
            f"quantize.comm.{collective}.block_size = {spec.block_size}: does not divide {what} of {fqn} "
            f"({numel}); allowed: a block size dividing every parameter shard"
        )


def _all_gather_params(cfg: CommConfig, spec: QuantSpec, params) -> list:
    out = []
    for fqn, fp in params:
        size = fp.padded_sharded_param_size
        mine = len(size) >= 2 and any(fnmatch.fnmatchcase(fqn, g) for g in cfg.all_gather_params)
        rows = size.numel() // size[-1]
        if mine and spec.scaling == "tile":
            _check_fits(fqn, rows, spec, "all_gather", "the shard rows")
        _check_fits(fqn, size[-1] if mine else 0, spec, "all_gather", "the last dim")
        out.append((fqn, size, spec if mine else None, fp))
    return out


def install(model: torch.nn.Module, cfg: CommConfig) -> int:
    """Give every FSDP2 unit of ``model`` the low-bit collectives ``cfg`` asks for.

    Returns:
        How many parameter groups got one (0 without FSDP2 sharding).

    Raises:
        ConfigError: a block size that does not divide a parameter's shard.
    """
    ag, rs = wire_spec(cfg.all_gather, "all_gather"), wire_spec(cfg.reduce_scatter, "reduce_scatter")
    count = 0
    for mod, pg, params in _groups(model):
        if pg.mesh_info.shard_mesh_size <= 1:
            continue
        torchao_fp8 = any(hasattr(fsdp_sharded_local(fp), "fsdp_pre_all_gather") for _, fp in params)
        if ag is not None and torchao_fp8:  # torchao's Float8 weights already all-gather in fp8
            mod.set_custom_all_gather(CountingAllGather([fp for _, fp in params]))
        elif ag is not None:
            mod.set_custom_all_gather(WireAllGather(_all_gather_params(cfg, ag, params)))
        if rs is not None:
            chunks = [(fqn, fp.padded_sharded_param_size.numel()) for fqn, fp in params]
            for fqn, n in chunks:
                _check_fits(fqn, n, rs, "reduce_scatter", "the gradient shard")
            mod.set_custom_reduce_scatter(WireReduceScatter(chunks, rs))
        count += 1
    return count


def with_wire_collectives(parallelize_fn, cfg: CommConfig):
    """Wrap a torchtitan ``parallelize_fn``: after FSDP2 is applied, install the low-bit collectives.

    Raises (when the wrapped function runs):
        ConfigError: nothing to install (no FSDP2 sharding: ``data_parallel_shard_degree`` = 1).
    """

    @functools.wraps(parallelize_fn)
    def wrapped(model, *args, **kwargs):
        model = parallelize_fn(model, *args, **kwargs)
        if install(model, cfg) == 0:
            raise ConfigError(
                "quantize.comm: FSDP2 shards nothing in this run (data_parallel_shard_degree = 1), so there "
                "is no all-gather or reduce-scatter to put in a low-bit format; allowed: "
                "data_parallel_shard_degree > 1, or quantize.comm formats 'high'"
            )
        return model

    wrapped.__lbt_wire_collectives__ = True
    return wrapped


def apply_comm(config, plans: dict) -> None:
    """Check ``[quantize.comm]`` and hook it into the model spec, before any model is built.

    Where the all-gather asks for e4m3 tensorwise and the plan has torchao Float8 layers, all of them
    tensorwise, torchao's own fp8 all-gather is switched on for them (``quantize.torchao``).

    Args:
        config: the trainer config.
        plans: the resolved plan of step 1 (``titan.targets.registry.ResolvedRun.plans``).

    Raises:
        ConfigError: a bad format / scaling, or a parallelism without FSDP2's collectives for it.
    """
    cfg = config.quantize.comm
    ag, rs = wire_spec(cfg.all_gather, "all_gather"), wire_spec(cfg.reduce_scatter, "reduce_scatter")
    if ag is None and rs is None:
        return
    _check_parallelism(config.parallelism, rs is not None)
    if _is_torchao_fp8(ag) and _all_float8_tensorwise(plans):
        config.quantize.torchao.enable_fsdp_float8_all_gather = True
    spec = config.model_spec
    if not getattr(spec.parallelize_fn, "__lbt_wire_collectives__", False):
        spec.parallelize_fn = with_wire_collectives(spec.parallelize_fn, cfg)


def _is_torchao_fp8(spec: QuantSpec | None) -> bool:
    """The wire format of torchao's fp8 all-gather: e4m3, one fp32 scale amax / 448 per tensor, nearest."""
    torchao = QuantSpec("e4m3", "tensor")
    return spec is not None and spec == dataclasses.replace(torchao, block_size=spec.block_size)


def _all_float8_tensorwise(plans: dict) -> bool:

    recipes = [torchao_recipe(p) for p in plans.values() if p.backends[0].startswith("torchao")]
    weights = [r.float8_casts[1][1] for r in recipes if r is not None and r.module == "Float8Linear"]
    return bool(weights) and all(w == "tensorwise" for w in weights)


def _check_parallelism(p, reduce_scatter: bool) -> None:
    if p.tensor_parallel_degree > 1 or p.expert_parallel_degree > 1:
        raise ConfigError(
            f"quantize.comm: tensor_parallel_degree = {p.tensor_parallel_degree}, expert_parallel_degree = "
            f"{p.expert_parallel_degree}: low-bit collectives are FSDP2's (weights sharded over data "
            "ranks only); allowed: both 1"
        )
    if reduce_scatter and p.data_parallel_replicate_degree > 1:
        raise ConfigError(
            f"quantize.comm.reduce_scatter: data_parallel_replicate_degree = {p.data_parallel_replicate_degree}"
            ": FSDP2 all-reduces replicated gradients with no custom-collective hook in torch 2.14; "
            "allowed: data_parallel_replicate_degree = 1"
        )


KIND = TargetKind(
    name="wire",
    what="an FSDP2 collective",
    switchable=False,
    convert=lambda config, run: apply_comm(config, run.plans),
)
"""FSDP2's weight all-gather and gradient reduce-scatter as a kind of plan target (``titan.targets.registry``): no
GEMM entries; its convert checks ``[quantize.comm]`` and hooks the model spec's parallelize function."""
