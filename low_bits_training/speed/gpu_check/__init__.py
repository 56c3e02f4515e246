"""The GPU check (``scripts/gpu_check.sh``): what of this package runs on the GPU at hand, in one command of at
most 8 minutes on one H100 from cold (docs/speed_model.md, "The GPU check").

The one home of every GPU check: ``catalog`` (the levels, their items and time budgets, what each needs and
installs; standard library only), ``runner`` (the command: budget, timing, exit codes), ``report`` (the
markdown table and the JSON), ``compiling`` (compile many variants without dynamo's silent eager fallback),
and the checks themselves: ``parity`` (CUDA against the CPU, the emulation against ``torch._scaled_mm`` and
torchao), ``block`` (step time of a Llama-3-8B-shaped block per recipe against bf16, next to the speed model),
``device`` (backends per recipe, CUDA-graph replay, the tensor-core GEMM, the NaN guard), ``training``
(torchtitan trains an emulated recipe with compile and CUDA graphs on).

Nothing here is imported by the package's other modules; ``scripts/gpu_check.py`` and
``benchmarks/bench_gpu.py`` are its entry points.
"""
