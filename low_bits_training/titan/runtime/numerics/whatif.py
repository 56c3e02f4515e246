"""What-if statistics in the trainer: which layers measure which alternatives, and their rows.

``titan.targets.registry.resolve_run`` resolves ``[numerics] whatif*`` against the model at config time (one-line
errors; the layers it names are built as QuantLinear); ``attach`` gives the built layers their tables; ``whatif_table`` reads the
layers' ``lbt_whatif`` buffers at the end of a statistics step, reduced over every rank, as
``numerics.jsonl`` rows marked ``"whatif": <name>``.
"""

from __future__ import annotations

import torch

from low_bits_training.nn import ROLE_NAMES
from low_bits_training.nn.whatif import WhatIfLinear, reset
from low_bits_training.numerics.whatif import whatif_identity, whatif_reduce_ops, whatif_rows
from low_bits_training.plan.whatif import resolve_whatif


def attach(layers: list[tuple[str, torch.nn.Module]], cfg) -> list[tuple[str, WhatIfLinear]]:
    """Give each selected layer of this rank its what-if table (``cfg``: the ``[numerics]`` section).

    Returns:
        ``(fqn, layer)`` of the layers that now record what-if statistics.
    """
    mine = [(f, m) for f, m in layers if isinstance(m, WhatIfLinear)]
    tables = resolve_whatif(cfg, [f for f, _ in mine], strict=False)  # a pipeline stage holds some layers
    for fqn, layer in mine:
        layer.attach_whatif(tables.get(fqn))
    return [(f, m) for f, m in mine if m.whatif is not None]


def reset_all(layers: list[tuple[str, WhatIfLinear]]) -> None:
    """Reset the what-if buffers (start of a step)."""
    for _, layer in layers:
        reset(layer.lbt_whatif)


def _local(layers) -> tuple[dict, dict]:
    raw, specs = {}, {}
    for fqn, layer in layers:
        for k, name in enumerate(layer.whatif.names):
            for i, role in enumerate(ROLE_NAMES):
                spec = layer.whatif.specs[k][i]
                if spec is not None:
                    raw[(fqn, role, name)] = layer.lbt_whatif[k, i]
                    specs[(fqn, role, name)] = spec.short()
    return raw, specs


def whatif_table(layers: list[tuple[str, WhatIfLinear]], step: int, gather, reduce) -> list[dict]:
    """The what-if rows of this statistics step (every rank calls it; rank order is irrelevant).

    Args:
        layers: this rank's what-if layers (``attach``).
        step: the training step.
        gather: the union of every rank's dict (``monitor._gather_union``).
        reduce: the slot-wise all-reduce of a raw stack (``monitor.reduce_raw``).
    """
    raw, specs = _local(layers)
    specs = gather(specs)
    keys = sorted(specs)
    if not keys:
        return []
    dev = next(iter(raw.values())).device if raw else torch.device("cpu")
    stack = torch.stack([raw[k] if k in raw else whatif_identity().to(dev) for k in keys])
    return whatif_rows(step, keys, reduce(stack, None, whatif_reduce_ops()), specs)
