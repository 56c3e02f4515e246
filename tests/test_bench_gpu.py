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


def test_gpu_checks_refuse_without_cuda_and_name_each_recipes_fallback_on_a_named_gpu():
    """The checks bench_gpu.py runs first: one line and exit 2 here; the fallback rows they would print on an
    H100 (what the CPU tests hold per recipe, config/backends.fallback_reason)."""
    p = subprocess.run([sys.executable, str(CHECKS)], capture_output=True, text=True, timeout=120)
    assert (p.returncode, p.stderr) == (2, "")
    assert p.stdout.startswith("gpu_checks: no CUDA device visible")
    spec = importlib.util.spec_from_file_location("gpu_checks", CHECKS)
    checks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(checks)
    from low_bits_training.config.backends import Hardware

    rows = dict((name, (status, detail)) for name, status, detail in checks._fallback_rows(
        Hardware("cuda", (9, 0)), ["fp8_rowwise", "mxfp8"]
    ))  # fmt: skip
    assert rows["fallback fp8_rowwise"] == ("info", "torchao")  # torchao's Float8Linear runs it on SM90
    assert rows["fallback mxfp8"][0] == "info" and "SM100" in rows["fallback mxfp8"][1]
