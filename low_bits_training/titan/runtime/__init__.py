"""The running trainer: its steps, checkpoints, metrics, the numerics monitor, profiling, the optimizer
container and the CUDA-graph policy."""
