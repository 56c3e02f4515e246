"""A torchtitan override for tests: the token embedding emits one NaN on its N-th forward call.

Activated with ``--override.imports tests.titan.nan_override.nan_embedding`` and ``LBT_TEST_NAN_CALL=N``
in the environment (the ranks run from the repository root, so ``tests.titan`` imports there). The NaN
enters the first transformer block and reaches the first quantized target downstream of it: an expert's
input when only the experts are quantized, Q K^T's input when only the attention products are.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from torchtitan.config.override import derive, override
from torchtitan.models.common import Embedding


class NaNEmbedding(Embedding):
    """``Embedding`` whose output gets one NaN (row 0, position 0, channel 0) on call ``LBT_TEST_NAN_CALL``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Embedding.Config):
        pass

    def forward(self, input):  # noqa: A002 (upstream's parameter name: torchtitan maps it by name)
        y = super().forward(input)
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == int(os.environ.get("LBT_TEST_NAN_CALL", "0")):
            y = y.clone()
            y[0, 0, 0] = float("nan")
        return y


@override(target=Embedding.Config, fqns=["*.tok_embeddings"], description="one NaN on a chosen call (tests)")
def nan_embedding(cfg):
    return derive(cfg, NaNEmbedding.Config)
