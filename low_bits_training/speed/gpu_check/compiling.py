"""Compile many variants of one module class without dynamo's silent eager fallback.

dynamo keeps one cache of compiled graphs per code object (``Block.forward``, ``QuantLinear.forward``) and
guards each on what differs between variants (a plan, a shape). Past ``torch._dynamo.config.recompile_limit``
(8 in torch 2.14) a new variant is not compiled: the call runs eagerly, with one warning in the log, and a
timing labelled "compiled" would be an eager one. ``compile_variants`` raises the limit to fit the variants.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

RECOMPILES_PER_VARIANT = 2
"""Graphs one variant may need (e.g. a first call without grad, then with); the limit leaves room for them."""


_VARIANTS = [0]
"""Variants handed to ``compile_variants`` in this process so far (the limit counts them all: a second call
compiles more variants of the same code)."""


def room_for(n_variants: int) -> int:
    """Raise ``recompile_limit`` (never lower it) so ``n_variants`` more variants all compile; returns it."""
    _VARIANTS[0] += n_variants
    cfg = torch._dynamo.config
    need = RECOMPILES_PER_VARIANT * _VARIANTS[0] + 8  # + torch's default, for what else this process compiles
    cfg.recompile_limit = max(cfg.recompile_limit, need)
    cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, need)
    return cfg.recompile_limit


def compile_variants(variants: Sequence[Callable], **compile_kwargs) -> list[Callable]:
    """``torch.compile`` each of ``variants`` with the recompile limit raised to fit them all.

    Args:
        variants: modules or functions sharing code (one class, several plans or shapes).
        compile_kwargs: passed to ``torch.compile`` (``backend``, ``mode``, ``dynamic``, ...).

    Returns:
        The compiled callables, in order. The limit stays raised for the process (the variants are
        compiled lazily, at their first call).
    """
    room_for(len(variants))
    return [torch.compile(v, **compile_kwargs) for v in variants]
