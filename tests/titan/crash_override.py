"""A torchtitan override for tests: rank ``LBT_TEST_CRASH_RANK`` (default 1) crashes while its trainer builds
the model (``crash_rank``), a ``RuntimeError`` no other rank sees.

Activated with ``--override.imports tests.titan.crash_override.crash_rank`` (the ranks run from the
repository root, so ``tests.titan`` imports there). The launcher's own check never builds the trainer, so
only the ranks apply it.
"""

from __future__ import annotations

import os

from torchtitan.config.override import override
from torchtitan.models.common import Embedding

MESSAGE = "crashed on purpose (tests/titan/crash_override.py)"
"""The exception's text; the launcher must show it whatever ``LOG_RANK`` shows."""


@override(target=Embedding.Config, fqns=["*.tok_embeddings"], description="one rank crashes (tests)")
def crash_rank(cfg):
    if os.environ.get("RANK") == os.environ.get("LBT_TEST_CRASH_RANK", "1"):
        raise RuntimeError(f"rank {os.environ['RANK']} {MESSAGE}")
    return cfg
