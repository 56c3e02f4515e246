"""What-if statistics in the trainer: which layers measure which alternatives, and their rows.

``titan.targets.registry.resolve_run`` resolves ``[numerics] whatif*`` against the model at config time, once
per process (one-line errors; the layers it names are built as QuantLinear): ``ResolvedRun.whatif``. ``attach``
gives this rank's built layers their tables from it; ``whatif_table`` reads the
layers' ``lbt_whatif`` buffers at the end of a statistics step, reduced over every rank, as
``numerics.jsonl`` rows marked ``"whatif": <name>``.
"""

from __future__ import annotations

import torch

from low_bits_training.nn import ROLE_NAMES
from low_bits_training.nn.whatif import WhatIf, WhatIfLinear, reset
from low_bits_training.numerics.whatif import whatif_identity, whatif_reduce_ops, whatif_rows


def attach(
    layers: list[tuple[str, torch.nn.Module]], tables: dict[str, WhatIf]
) -> list[tuple[str, WhatIfLinear]]:
    """Give each layer of this rank its what-if table (a pipeline stage holds some of the run's layers).

    Args:
        layers: ``(fqn, module)`` of this rank's targets.
        tables: FQN -> ``WhatIf``, the resolved run's (``ResolvedRun.whatif``).

    Returns:
        ``(fqn, layer)`` of the layers that now record what-if statistics.
    """
    mine = [(f, m) for f, m in layers if isinstance(m, WhatIfLinear)]
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
