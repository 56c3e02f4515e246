"""Whole-config checks the launcher runs once, before torchrun starts any rank.

``build_config`` already refuses unknown keys, wrong types, bad plans and optimizer options, and runs
torchtitan's own cross-field checks. What only shows up later, as a bare ``AssertionError`` or a silent
no-op on every rank, is checked here and refused in one line naming the key, the value and what is allowed:
value ranges (``steps = -3`` trained nothing, ``lr = -3e-3`` trained backwards), the parallel degrees
against the number of processes, the sequence length against TP / CP, and the model's own checks against
the run (``update_from_config`` on a copy: TP must divide the heads, ``seq_len`` within RoPE's range).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torchtitan.tools.utils as titan_utils

from low_bits_training.config.comm import check_shard_degree
from low_bits_training.errors import ConfigError
from low_bits_training.titan.runtime.checkpoint import preflight
from low_bits_training.titan.runtime.manifest import fingerprint
from low_bits_training.titan.runtime.numerics.monitor import layer_probes_work
from low_bits_training.titan.runtime.optim import check_in_backward
from low_bits_training.titan.targets.attention import check_attention_memory
from low_bits_training.titan.targets.registry import run_of

# (key, smallest allowed value, note); the key is the TOML / flag path.
RANGES: tuple[tuple[str, float, str], ...] = (
    ("training.steps", 1, ""),
    ("training.local_batch_size", 1, ""),
    ("training.seq_len", 1, ""),
    ("training.max_norm", 0, "gradient clipping norm; 0 clips every gradient to zero"),
    ("training.gc_freq", 1, ""),
    ("metrics.log_freq", 1, ""),
    ("checkpoint.interval", 1, ""),
    ("checkpoint.keep_latest_k", 0, "0: keep all"),
    ("lr_scheduler.warmup_steps", 0, ""),
    ("lr_scheduler.min_lr_factor", 0, ""),
    ("validator.freq", 1, ""),
    ("parallelism.data_parallel_replicate_degree", 1, ""),
    ("parallelism.tensor_parallel_degree", 1, ""),
    ("parallelism.pipeline_parallel_degree", 1, ""),
    ("parallelism.context_parallel_degree", 1, ""),
    ("parallelism.expert_parallel_degree", 1, ""),
)
STRICT = frozenset({"training.max_norm"})
"""Keys whose bound itself is not allowed (> instead of >=)."""
GROUP_RANGES = (("lr", 0), ("weight_decay", 0), ("eps", 0))
"""Numeric optimizer kwargs of every ``[[optimizer.param_groups]]`` entry and their lower bounds."""


def _get(config: Any, key: str) -> Any:
    obj = config
    for part in key.split("."):
        obj = getattr(obj, part, None)
    return obj


def check_ranges(config: Any) -> None:
    """Every ``RANGES`` key and every param group's ``lr`` / ``weight_decay`` / ``eps`` / ``betas``.

    Raises:
        ConfigError: the first value out of range.
    """
    for key, low, note in RANGES:
        v = _get(config, key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            bad = v <= low if key in STRICT else v < low
            if bad or (isinstance(v, float) and math.isnan(v)):
                op = ">" if key in STRICT else ">="
                kind = "an int" if isinstance(v, int) else "a number"
                what = f"{kind} {op} {low}" + (f" ({note})" if note else "")
                raise ConfigError(f"{key} = {v!r}: expected {what}")
    gbs = config.training.global_batch_size
    if gbs != -1 and gbs < 1:
        raise ConfigError(
            f"training.global_batch_size = {gbs!r}: expected -1 (local x data-parallel) or >= 1"
        )
    for i, group in enumerate(getattr(config.optimizer, "param_groups", [])):
        _check_group(i, group.optimizer_kwargs or {})


def _check_group(i: int, kwargs: dict[str, Any]) -> None:
    where = f"optimizer.param_groups[{i}].optimizer_kwargs"
    for name, low in GROUP_RANGES:
        v = kwargs.get(name)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and not v >= low:
            raise ConfigError(f"{where}.{name} = {v!r}: expected a number >= {low}")
    betas = kwargs.get("betas")
    if isinstance(betas, (list, tuple)) and not all(
        isinstance(b, (int, float)) and 0 <= b < 1 for b in betas
    ):
        raise ConfigError(f"{where}.betas = {list(betas)!r}: expected numbers in [0, 1)")


@dataclass(frozen=True)
class Layout:
    """The parallel degrees of a run once ``data_parallel_shard_degree = -1`` is filled in."""

    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int

    @property
    def data_ranks(self) -> int:
        """Data-parallel degree: how many ranks read different data."""
        return self.dp_replicate * self.dp_shard


def parallel_layout(config: Any, world_size: int) -> Layout:
    """The degrees of ``[parallelism]`` checked against ``world_size`` processes (NGPU x nodes).

    Raises:
        ConfigError: a degree below 1 (other than ``data_parallel_shard_degree = -1``), or degrees whose
            product is not the number of processes.
    """
    p = config.parallelism
    keys = ("data_parallel_replicate_degree", "context_parallel_degree", "tensor_parallel_degree",
            "pipeline_parallel_degree")  # fmt: skip
    dp_r, cp, tp, pp = (getattr(p, k) for k in keys)
    dp_s, others = p.data_parallel_shard_degree, dp_r * cp * tp * pp
    named = ", ".join(f"{k} = {getattr(p, k)}" for k in keys if getattr(p, k) != 1)
    if dp_s == -1:
        if world_size % others:
            raise ConfigError(
                f"parallelism: {named} multiply to {others}, which does not divide the {world_size} "
                f"processes (NGPU x nodes); allowed: degrees whose product divides {world_size}"
            )
        dp_s = world_size // others
    elif dp_s < 1:
        raise ConfigError(f"parallelism.data_parallel_shard_degree = {dp_s}: expected -1 (fill) or >= 1")
    elif dp_s * others != world_size:
        raise ConfigError(
            f"parallelism.data_parallel_shard_degree = {dp_s}: with {named or 'the other degrees at 1'} the "
            f"degrees multiply to {dp_s * others}, but NGPU x nodes = {world_size} processes; allowed: degrees "
            f"whose product is {world_size} (data_parallel_shard_degree = -1 fills in the rest)"
        )
    return Layout(dp_r, dp_s, cp, tp, pp)


def check_sequence(config: Any, layout: Layout) -> None:
    """``seq_len`` must split evenly under sequence / context parallelism (torchtitan's trainer checks this
    only once every rank has started).

    Raises:
        ConfigError: it does not.
    """
    sp = layout.tp if config.parallelism.enable_sequence_parallel else 1
    divisor = sp * (2 * layout.cp if layout.cp > 1 else 1)
    if config.training.seq_len % divisor:
        raise ConfigError(
            f"training.seq_len = {config.training.seq_len}: expected a multiple of {divisor} "
            f"(tensor_parallel_degree {layout.tp} with sequence parallel x 2 x context_parallel_degree)"
        )


def check_comm(config: Any, layout: Layout) -> None:
    """``[quantize.comm]`` against the resolved degrees (its formats and the other degrees were checked when
    the config was built, ``titan.targets.wire.apply_comm``).

    Raises:
        ConfigError: low-bit collectives without FSDP2 sharding (``config.comm.check_shard_degree``).
    """

    quantize = getattr(config, "quantize", None)
    if quantize is not None:
        check_shard_degree(quantize.comm, layout.dp_shard)


def check_numerics(config: Any, layout: Layout) -> None:
    """Per-layer statistics need the layers' probes, which do not run under PP with torch.compile
    (``titan.runtime.numerics.monitor.layer_probes_work``).

    Raises:
        ConfigError: ``[numerics] stats_freq`` or ``whatif`` with ``pipeline_parallel_degree > 1`` and compile.
    """
    numerics = getattr(config, "numerics", None)
    if numerics is None or layer_probes_work(layout.pp, config.compile.enable):
        return
    for key, value in (("stats_freq", numerics.stats_freq), ("whatif", numerics.whatif)):
        if value:
            raise ConfigError(
                f"numerics.{key} = {value!r}: per-layer statistics are not collected under pipeline "
                f"parallelism (pipeline_parallel_degree = {layout.pp}) with compile.enable = true; "
                f"turn one of them off"
            )


def check_autopilot(config: Any, layout: Layout) -> None:
    """``[quantize.autopilot]`` reads the layers' NaN flags and statistics and switches their plans.

    Raises:
        ConfigError: the autopilot on under pipeline parallelism (a stage cannot name another stage's
            roles), or its non-finite trigger with ``numerics.nonfinite = "off"`` (no flags to read).
    """
    pilot = config.quantize.autopilot
    if not pilot.enable:
        return
    if layout.pp > 1:
        raise ConfigError(
            f"quantize.autopilot.enable = true: not under pipeline parallelism (pipeline_parallel_degree = "
            f"{layout.pp}); turn one of them off"
        )
    if pilot.nonfinite and config.numerics.nonfinite == "off":
        raise ConfigError(
            'quantize.autopilot.nonfinite = true reads the layers\' NaN flags: set numerics.nonfinite to "warn", '
            '"skip" or "stop", or quantize.autopilot.nonfinite = false'
        )


def device_memory() -> int:
    """Bytes of one device as torchtitan's device module gives them (the CPU adapter's: the host's RAM;
    0: unknown)."""
    try:
        return int(titan_utils.device_module.get_device_properties(0).total_memory)
    except (AssertionError, RuntimeError, AttributeError):
        return 0


def model_as_trained(config: Any) -> Any:
    """A copy of the model config as the trainer will hold it (after ``update_from_config``).

    Raises:
        ConfigError: the model's own checks refuse the run (TP that does not divide the heads, a
            ``seq_len`` beyond RoPE's range, weight tying with PP, ...).
    """
    if config.model_spec is None:
        return None
    model = copy.deepcopy(config.model_spec.model)
    try:
        model.update_from_config(config=config)
    except (ValueError, NotImplementedError, AssertionError) as e:
        raise ConfigError(f"model {config.model_spec.flavor!r}: {(str(e).splitlines() or [''])[0]}") from None
    return model


def trained_fingerprint(config: Any, model: Any) -> dict[str, Any] | None:
    """The fingerprint the trainer will give its checkpoints (``manifest.fingerprint`` of the config with
    the model config as trained)."""
    if model is None:
        return None
    spec = SimpleNamespace(model=model, flavor=getattr(config.model_spec, "flavor", None))
    view = SimpleNamespace(
        model_spec=spec, quantize=getattr(config, "quantize", None), optimizer=config.optimizer
    )
    return fingerprint(view)


def check_run(config: Any, world_size: int) -> str | None:
    """Everything above, then the checkpoint the run would resume from (``checkpoint.preflight``).

    Args:
        config: the resolved config (``worker.build_config``).
        world_size: processes of the run (NGPU x nodes).

    Returns:
        The checkpoint path the run resumes from (None: a fresh start).

    Raises:
        ConfigError: a value out of range, degrees that do not fit the processes, a model check.
        CheckpointError: a checkpoint the run could not resume.
    """
    check_ranges(config)
    layout = parallel_layout(config, world_size)
    check_sequence(config, layout)
    check_comm(config, layout)
    check_numerics(config, layout)
    check_autopilot(config, layout)
    check_in_backward(config, layout)
    check_attention_memory(config, run_of(config).plans, device_memory())
    model = model_as_trained(config)
    return preflight(config, trained_fingerprint(config, model), layout.data_ranks)
