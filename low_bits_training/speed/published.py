"""Published speedups over bf16 and the speed model's predictions of them (``lbt-speed --published``).

Each entry names its source (``SOURCES``; docs/speed_model.md quotes the setups), the GPU, our recipe that
computes the same plan, what was measured (a training step, or GEMMs with or without their quantization),
and ``bound``: the relative error the docs report for it, which ``tests/speed`` holds the model to.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .gpus import gpu
from .model import GemmTarget
from .params import PARAMS, SpeedParams
from .predict import Prediction, predict
from .workloads import LLAMA3_8B, TE_5B, decoder_targets, recipe_plans

Measure = Literal["step", "gemm", "kernels"]
"""What a figure measures: a training step; GEMMs with their quantization (Transformer Engine's autocast,
torchao's linear benchmarks); GEMM kernels alone on pre-quantized inputs."""

SOURCES: dict[str, str] = {
    "ao-mx": "https://github.com/pytorch/ao/tree/main/torchao/prototype/mx_formats (training e2e, B200)",
    "ao-f8": "https://github.com/pytorch/ao/tree/main/torchao/float8 (training benchmarks, H100)",
    "ao-f8-roofline": "https://github.com/pytorch/ao/tree/main/torchao/float8 (performance examples, H100)",
    "tt-nvfp4": "https://github.com/pytorch/torchtitan/blob/main/torchtitan/components/quantization/nvfp4.md",
    "te-gemm": "https://github.com/NVIDIA/TransformerEngine/blob/main/docs/examples/gemm_profiling/gemm_profiling.rst",
}


@dataclass(frozen=True)
class Published:
    """One published speedup over bf16."""

    label: str
    source: str
    gpu: str
    recipe: str
    value: float
    measure: Measure
    setup: str
    """"torchao_8b" (Llama 3 8B, 1 x 8192 tokens a GPU, per-op AC), "torchtitan_8b" (32 x 2048), "te_5b"
    (31 x 512 tokens, linears only), "linear_small" / "linear_large" (one linear, torchao's examples)."""
    bound: float
    """The documented bound on |predicted / published - 1|."""
    fp8_all_gather: bool = False
    """FSDP2 all-gathers the weight cast to fp8 (each GPU casts 1/8 of it)."""
    bf16_tail: int = 0
    """Last blocks kept in bf16."""


PUBLISHED: tuple[Published, ...] = (
    Published("torchao Llama3-8B fp8 tensorwise + fp8 all-gather", "ao-mx", "B200", "fp8_tensorwise", 1.254, "step", "torchao_8b", 0.15, True),
    Published("torchao Llama3-8B mxfp8 (cuBLAS)", "ao-mx", "B200", "mxfp8", 1.200, "step", "torchao_8b", 0.15),
    Published("torchao Llama3-8B fp8 rowwise", "ao-mx", "B200", "fp8_rowwise", 1.040, "step", "torchao_8b", 0.20),
    Published("torchao Llama3-8B fp8 tensorwise + fp8 all-gather", "ao-f8", "H100", "fp8_tensorwise", 1.250, "step", "torchao_8b", 0.15, True),
    Published("torchao Llama3-8B fp8 rowwise", "ao-f8", "H100", "fp8_rowwise", 1.100, "step", "torchao_8b", 0.15),
    Published("torchtitan Llama3-8B MXFP8 (32x32 weight tiles)", "tt-nvfp4", "B200", "mxfp8_2d_weights", 1.281, "step", "torchtitan_8b", 0.15),
    Published("torchtitan Llama3-8B NVFP4, last 5 of 32 blocks bf16", "tt-nvfp4", "B200", "nvfp4", 1.370, "step", "torchtitan_8b", 0.15, bf16_tail=5),
    Published("TE 5B GEMMs + quantization, MXFP8", "te-gemm", "B300", "mxfp8", 1.420, "gemm", "te_5b", 0.15),
    Published("TE 5B GEMMs + quantization, NVFP4", "te-gemm", "B300", "nvfp4", 1.977, "gemm", "te_5b", 0.15),
    Published("TE 5B GEMMs + quantization, FP8 current scaling", "te-gemm", "B300", "fp8_tensorwise", 1.395, "gemm", "te_5b", 0.15),
    Published("TE 5B GEMMs + quantization, FP8 delayed scaling", "te-gemm", "B300", "fp8_delayed", 1.635, "gemm", "te_5b", 0.15),
    Published("TE 5B GEMMs + quantization, FP8 current scaling", "te-gemm", "H200-NVL", "fp8_tensorwise", 1.578, "gemm", "te_5b", 0.15),
    Published("TE 5B GEMMs + quantization, FP8 delayed scaling", "te-gemm", "H200-NVL", "fp8_delayed", 1.687, "gemm", "te_5b", 0.15),
    Published("TE 5B GEMMs + quantization, FP8 block scaling", "te-gemm", "H200-NVL", "deepseek_fp8", 1.399, "gemm", "te_5b", 0.25),
    Published("TE 5B GEMM kernels (pre-quantized), MXFP8", "te-gemm", "B300", "mxfp8", 1.830, "kernels", "te_5b", 0.15),
    Published("TE 5B GEMM kernels (pre-quantized), NVFP4", "te-gemm", "B300", "nvfp4", 3.481, "kernels", "te_5b", 0.15),
    Published("TE 5B GEMM kernels (pre-quantized), FP8", "te-gemm", "H200-NVL", "fp8_tensorwise", 1.905, "kernels", "te_5b", 0.15),
    Published("torchao linear fwd+bwd 1024x2048x1024, fp8 tensorwise", "ao-f8-roofline", "H100", "fp8_tensorwise", 0.80, "gemm", "linear_small", 0.30),
    Published("torchao linear fwd+bwd 4096x8192x16384, fp8 tensorwise", "ao-f8-roofline", "H100", "fp8_tensorwise", 1.39, "gemm", "linear_large", 0.15),
)  # fmt: skip
"""Every published figure the model is held against (docs/speed_model.md quotes each setup)."""


def targets_for(p: Published) -> list[GemmTarget]:
    """The GEMM targets of one GPU's step in ``p``'s setup."""
    last = {LLAMA3_8B.n_layers - 1 - i for i in range(p.bf16_tail)}
    plans = recipe_plans(p.recipe, last)
    if p.setup == "torchao_8b":
        return decoder_targets(LLAMA3_8B, 1, 8192, plans, 0.5, 1 / 8 if p.fp8_all_gather else 1.0)
    if p.setup == "torchtitan_8b":
        return decoder_targets(LLAMA3_8B, 32, 2048, plans, 0.5)
    if p.setup == "te_5b":
        return decoder_targets(TE_5B, 31, 512, plans, attention=False)
    m, k, n = {"linear_small": (1024, 2048, 1024), "linear_large": (4096, 8192, 16384)}[p.setup]
    return [GemmTarget("linear", k, n, m, plans("linear", 0))]


def predicted(p: Published, params: SpeedParams = PARAMS) -> tuple[float, Prediction]:
    """The model's figure for ``p`` (the quantity ``p.measure`` names) and the prediction behind it."""
    pred = predict(targets_for(p), gpu(p.gpu), params)
    value = {
        "step": pred.speedup,
        "gemm": pred.gemm_speedup,
        "kernels": pred.bf16_gemm_seconds / pred.gemm_seconds,
    }[p.measure]
    return value, pred


def comparison(params: SpeedParams = PARAMS) -> list[tuple[Published, float, float]]:
    """(entry, predicted, relative error predicted / published - 1) for every published figure."""
    out = []
    for p in PUBLISHED:
        value, _ = predicted(p, params)
        out.append((p, value, value / p.value - 1.0))
    return out
