"""Moved: the GPU checks live in ``low_bits_training/speed/gpu_check`` (``scripts/gpu_check.sh``). This runs the
items ``benchmarks/bench_gpu.py`` runs first (backends, CUDA-graph replay, tensor-core GEMM, NaN guard)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
if __name__ == "__main__":
    from bench_gpu import refuse_without_cuda, run_checks

    refuse_without_cuda()
    sys.exit(run_checks())
