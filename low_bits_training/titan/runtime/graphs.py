"""CUDA graphs: on where everything in the captured step is capturable, off with one line naming why.

torchtitan 0.3 captures each microbatch's forward + backward in a CUDA graph unless
``training.disable_cuda_graphs`` is set (trainer.py wraps ``_forward_backward_body``: one warm-up call,
then capture, then replay). What runs inside must stay fixed on the device: no host-to-device copy, no
host read, no Python state that differs between steps (the replay repeats the captured kernels, whatever
Python would do now). The quantized layers' own step is such (the stochastic-rounding key lives on the
device, filled in place; no small tensors made from host data; tests/nn/test_gpu_hot_path.py), and the
per-microbatch work outside the captured call (the step key, the NaN / Inf flags) stays outside it.

What a run may turn on that is not capturable, each a reason ``graph_blockers`` names:

- statistics steps and what-if (``[numerics] stats_freq`` / ``whatif``): the probes record what the
  process-wide mode says, read when the graph is captured, so a replay would never switch it;
- ``[[quantize.phases]]``: the plan (which casts run) changes between phases;
- ``[quantize.autopilot]``: it switches a role's plan mid-run (a replay would keep the captured casts), its
  triggers read statistics a replay never records, and a step it redoes after a NaN would replay the same
  graph until ``max_redos`` runs out;
- ``numerics.nonfinite = "skip"``: drops a step by setting ``p.grad = None``; a graph keeps static grads;
- the low-bit optimizers' ``in_backward``: their hooks update parameters inside the backward, reading each
  parameter's step counter on the host, and set its gradient to None;
- ``[quantize.comm]`` low-bit collectives: their stochastic-rounding keys and byte counters are host state;
- torchao's FSDP fp8 scale precompute: assigns new tensors after every optimizer step;
- emulated MoE experts: the grouped GEMM (``nn.grouped.grouped_mm``) reads the group offsets on the host;
- pipeline parallelism: torchtitan captures no PP schedule (its own config check refuses the combination, so
  this reason is applied before that check: ``graphs_off_before_check``).

The non-finite check of the default ``nonfinite = "warn"`` reads the flags after each microbatch, outside
the captured call: one device-to-host sync per microbatch (the host waits for the microbatch's kernels
before it queues the next microbatch), not a reason to turn graphs off.
"""

from __future__ import annotations

from typing import Any

from torchtitan.tools.logging import logger

from low_bits_training.config.comm import wire_spec
from low_bits_training.titan.runtime.optim import in_backward_groups
from low_bits_training.titan.targets.expert_modules import TitanQuantGroupedExperts

GRAPHS_OFF = "CUDA graphs off"
"""How the one log line starts."""
PIPELINE = "pipeline parallelism (torchtitan captures no PP schedule)"
"""The reason known before the run is resolved (``graphs_off_before_check``)."""


def graph_blockers(config: Any) -> list[str]:
    """What in a resolved run cannot be captured in a CUDA graph (see the module doc); empty: nothing.

    Args:
        config: the resolved ``LowBitsTrainer.Config`` (after ``targets.apply_run``).
    """

    num, quant = config.numerics, config.quantize
    checks = (
        (config.parallelism.pipeline_parallel_degree > 1, PIPELINE),
        (num.stats_freq > 0 or bool(num.whatif), "[numerics] statistics steps switch what the layers record"),
        (bool(quant.phases), "[[quantize.phases]] change the plan mid-run"),
        (quant.autopilot.enable, "[quantize.autopilot] switches plans and redoes steps mid-run"),
        (num.nonfinite == "skip", "numerics.nonfinite = 'skip' drops gradients the graph keeps"),
        (
            bool(in_backward_groups(config)),
            "optimizer_kwargs.in_backward updates parameters in the backward (a host read) and frees their gradients",
        ),
        (
            any(wire_spec(getattr(quant.comm, c), c) is not None for c in ("all_gather", "reduce_scatter")),
            "[quantize.comm] low-bit collectives keep their rounding keys and byte counts on the host",
        ),
        (
            quant.torchao.precompute_float8_dynamic_scale_for_fsdp,
            "torchao's FSDP fp8 scale precompute assigns new tensors after every step",
        ),
        (_emulated_experts(config), "emulated MoE experts (the grouped GEMM reads its group offsets on the host)"),
    )  # fmt: skip
    return [why for hit, why in checks if hit]


def _emulated_experts(config: Any) -> bool:
    model = config.model_spec.model
    return any(True for _ in model.traverse(TitanQuantGroupedExperts.Config))


def apply_graph_policy(config: Any, on_cpu: bool) -> str | None:
    """Turn CUDA graphs off where ``graph_blockers`` finds a reason (a CPU run has them off already).

    Returns:
        The one line logged (``CUDA graphs off: <reasons>``), or None when graphs stay as configured.
    """
    if on_cpu or config.training.disable_cuda_graphs:
        return None
    reasons = graph_blockers(config)
    if not reasons:
        return None
    return _turn_off(config, reasons)


def graphs_off_before_check(config: Any, on_cpu: bool) -> str | None:
    """The policy's reason known before the run is resolved, applied before torchtitan's own config check
    (``Trainer.Config.__post_init__``, which tyro also runs as it reads the command line), which refuses
    pipeline parallelism while CUDA graphs are on: ``worker.build_config`` calls this first and
    ``apply_graph_policy`` once the run is resolved.

    Returns:
        The one line logged (``CUDA graphs off: pipeline parallelism ...``), or None (no pipeline, or a CPU run).
    """
    if on_cpu or config.parallelism.pipeline_parallel_degree <= 1:
        return None
    return _turn_off(config, [PIPELINE])


def _turn_off(config: Any, reasons: list[str]) -> str:
    config.training.disable_cuda_graphs = True
    line = f"{GRAPHS_OFF}: {'; '.join(reasons)}"
    logger.info(line)
    return line


def graph_policy(config: Any, gpu: bool, set_by_user: bool) -> str:
    """What a run gets on a GPU (``lbt-doctor --hardware``): ``on: ...`` or ``off: <why>``.

    Args:
        config: the resolved config, as ``graph_blockers`` takes it.
        gpu: judged on a CUDA GPU (else: off, a CPU run).
        set_by_user: the TOML or the command line set ``training.disable_cuda_graphs`` to true.
    """
    if not gpu:
        return "off: no GPU (a CPU run; --hardware sm90 judges a GPU's)"
    if set_by_user:
        return "off: training.disable_cuda_graphs = true"
    reasons = graph_blockers(config)
    if reasons:
        return f"off: {'; '.join(reasons)}"
    return "on: torchtitan captures each microbatch's forward + backward once and replays it"
