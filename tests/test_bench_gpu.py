"""benchmarks/bench_gpu.py on this GPU-less machine: the one-line refusal, and the rows it would measure (what
backend "auto" picks, torchao rows unavailable with the reason) with and without torchao installed."""

import importlib.util
import subprocess
import sys

import torch

from helpers import REPO

BENCH = REPO / "benchmarks" / "bench_gpu.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_refuses_without_cuda_in_one_line():
    p = subprocess.run([sys.executable, str(BENCH)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr == ""
    assert p.stdout.splitlines() == [
        "bench_gpu: no CUDA device visible; this benchmark needs a GPU (CPU: benchmarks/bench_linear.py)"
    ]


def test_rows_name_the_backend_auto_picks_and_why_torchao_is_missing():
    bench = _bench()
    lin = torch.nn.Linear(256, 512, bias=False)
    rows = bench.candidates(lin, "fp8_rowwise", 256)
    assert [(label, picks) for label, picks, _ in rows] == [
        ("QuantLinear (emulate)", "emulate"),
        ("torchao Float8Linear: unavailable (Float8Linear kernels need CUDA SM89+, this is CPU)", "emulate"),
    ]
    ours = rows[0][2]
    x = torch.randn(256, 256)
    assert (
        torch.equal(ours(x), torch.nn.functional.linear(x, lin.weight)) is False
    )  # fp8: not the fp32 result
    assert bench.candidates(lin, "nvfp4", 256)[1][0] == "torchao: no module computes this plan"


def test_rows_without_torchao_or_torchtitan():
    code = (
        "import sys, importlib.util, torch\n"
        "sys.modules['torchao'] = None; sys.modules['torchtitan'] = None\n"
        f"spec = importlib.util.spec_from_file_location('b', {str(BENCH)!r})\n"
        "b = importlib.util.module_from_spec(spec); spec.loader.exec_module(b)\n"
        "rows = b.candidates(torch.nn.Linear(256, 256, bias=False), 'mxfp8', 256)\n"
        "print(rows[1][0]); print(rows[0][2](torch.randn(64, 256)).shape)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.splitlines() == [
        "torchao MXFP8Linear: unavailable (torchao is not installed)",
        "torch.Size([64, 256])",
    ]


CHECKS = REPO / "benchmarks" / "gpu_checks.py"


def test_gpu_checks_wrapper_refuses_without_cuda_in_one_line():
    """benchmarks/gpu_checks.py now runs the GPU check's items (low_bits_training/speed/gpu_check)."""
    p = subprocess.run([sys.executable, str(CHECKS)], capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stderr) == (2, "")
    assert p.stdout.startswith("bench_gpu: no CUDA device visible")


def test_the_checks_bench_gpu_runs_first_are_items_of_the_gpu_check():
    from low_bits_training.speed.gpu_check.catalog import LEVELS

    names = [i.name for lv in LEVELS if lv.number in (1, 2) for i in lv.items]
    for check in _bench().CHECKS:  # each selects exactly one item (runner --items matches substrings)
        assert sum(check in n for n in names) == 1, check
