"""torchtitan overrides for tests: the token embedding emits one NaN on its N-th forward call (``nan_embedding``);
the final norm scales its output on its N-th call, a loss spike (``spike_norm``, ``LBT_TEST_SPIKE_CALL=N``).

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
from torchtitan.models.common.nn_modules import RMSNorm


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


class SpikeNorm(RMSNorm):
    """``RMSNorm`` whose output is scaled by ``LBT_TEST_SPIKE_SCALE`` (default 30) on call
    ``LBT_TEST_SPIKE_CALL``: as the model's final norm, logits 30x as sharp on one step, a loss spike (a
    transient fault: the step's state and batch are fine)."""

    @dataclass(kw_only=True, slots=True)
    class Config(RMSNorm.Config):
        pass

    def forward(self, x):
        y = super().forward(x)
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == int(os.environ.get("LBT_TEST_SPIKE_CALL", "0")):
            y = y * float(os.environ.get("LBT_TEST_SPIKE_SCALE", "30"))
        return y


@override(target=RMSNorm.Config, fqns=["*.model.norm"], description="a loss spike on a chosen call (tests)")
def spike_norm(cfg):
    return derive(cfg, SpikeNorm.Config)
