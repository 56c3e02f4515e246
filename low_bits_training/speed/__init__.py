"""What a precision plan buys on a GPU: a speed model of every GEMM of a step and the casts it needs, held to
published results (docs/speed_model.md). Pure arithmetic: imports formats/, nn/ and config/, never torchtitan.

The entry points: ``predict`` (targets -> step speedup over bf16 and its Amdahl ceiling on a named GPU), the
GPU table ``GPUS``, the one parameter set ``PARAMS``, decoder builders in ``speed.workloads`` and the
published figures in ``speed.published``. ``lbt-speed`` runs it on a run config's resolved plan.
"""

from .gpus import GPUS, GpuSpec, gpu
from .model import GemmTarget, gemm_dtype
from .params import PARAMS, SpeedParams
from .predict import Prediction, predict

__all__ = [
    "GPUS",
    "PARAMS",
    "GemmTarget",
    "GpuSpec",
    "Prediction",
    "SpeedParams",
    "gemm_dtype",
    "gpu",
    "predict",
]
