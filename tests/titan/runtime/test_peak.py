"""The peak-memory plan (``titan/runtime/peak.py``) against the allocator, its count, and the launcher's refusal.

The plan runs the run's own model, parallelisms and optimizers for two steps on fake tensors and counts every
storage (``optim.memory.LiveStorages``); the run measures one step with the allocator (``HeldBytes``: the
profiler's allocation events on the CPU, above the tensors alive at the step's start) and writes both into
``peak_memory.json``."""

import json
import subprocess
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from helpers import CORPUS, REPO, train, write_toml
from low_bits_training.config.memory import FREE_FRACTION
from low_bits_training.optim.memory import HeldBytes, LiveStorages
from low_bits_training.run.folder import PEAK_JSON
from low_bits_training.titan.launch.memory import refusal
from low_bits_training.titan.runtime.peak import PeakPlan

LEAN = REPO / "train_configs" / "debug_lean.toml"
M100 = object()
"""The debug preset on the ~100M base (a TOML each test writes)."""
SHAPE = ("--training.local_batch_size", "4", "--training.seq_len", "256", "--training.steps", "2")


def test_the_count_follows_every_storage_from_its_op_to_its_last_reference():
    with FakeTensorMode():
        count = LiveStorages()
        with count:
            count.phase = "a"
            x = torch.empty(1000)  # 4,000 B
            view = x[10:20]  # the same storage: not counted again
            y = x * 2  # 4,000 B more
            assert count.now == 8000
            del y
            assert count.now == 4000
            count.phase = "b"
            z = torch.empty(250, dtype=torch.float64)  # 2,000 B
            assert count.now == 6000 and count.peak == 8000
            x.untyped_storage().resize_(0)  # FSDP2 frees its all-gather buffers this way
            assert count.now == 2000
            del view, x, z
        assert count.now == 0 and count.peak == 8000 and count.parts() == {"a": 8000}


def test_the_count_rounds_each_storage_as_the_cuda_allocator_does():
    with FakeTensorMode():
        count = LiveStorages(round_to=512)
        with count:
            a = torch.empty(10, dtype=torch.uint8)
            b = torch.empty(129)  # 516 B -> 1,024
            assert count.now == 512 + 1024
        del a, b


def test_the_allocator_meter_measures_the_peak_above_what_was_alive():
    keep = torch.empty(1 << 18)  # 1 MiB alive before
    meter = HeldBytes("cpu")
    with meter.recording():
        big = torch.empty(1 << 20)  # 4 MiB
        del big
        small = torch.empty(1 << 19)  # 2 MiB: below the peak
    assert meter.start >= keep.untyped_storage().nbytes()
    assert meter.peak == 4 << 20
    del small


def test_the_refusal_names_the_peak_its_largest_parts_and_the_change_that_fits():
    gib = 2**30
    plan = PeakPlan(
        3 * gib,
        3 * gib,
        {"parameters": gib, "optimizer states": 2 * gib // 3, "forward and backward": gib},
        "forward and backward",
    )
    fits = [("--activation_checkpoint selective", PeakPlan(int(1.5 * gib), int(1.5 * gib)))]
    line = refusal(plan, 2 * gib, "memory.limit_gib = 2", fits)
    assert line.startswith(
        "memory: rank 0 would peak at 3.00 GiB (parameters 1.00, forward and backward 1.00, "
    )
    assert f"over {FREE_FRACTION} x 2.00 GiB (memory.limit_gib = 2)" in line
    assert line.endswith(
        "--activation_checkpoint selective plans 1.50 GiB (or set memory.limit_gib or --memory.no-plan)"
    )
    nothing = refusal(plan, 2 * gib, "memory.limit_gib = 2", [("--activation_checkpoint full", plan)])
    assert (
        "no change tried fits (--activation_checkpoint full; lbt-doctor --fit plans every change)" in nothing
        and "\n" not in nothing
    )


CASES = {
    "eager, 1 rank": (1, (), None),
    "selective AC": (1, ("--activation_checkpoint", "selective"), None),
    "full AC": (1, ("--activation_checkpoint", "full"), None),
    "2 FSDP2 ranks": (2, ("--parallelism.data_parallel_shard_degree", "2"), None),
    "lean preset, 2 ranks (bf16 parameters, 4-bit LowBitAdamW states, e4m3 saved activations)": (2, (), LEAN),
    # tensor parallelism: planned under torchtitan's own train context, as its collectives run (17% over without)
    "TP, 2 ranks": (2, (), REPO / "train_configs" / "debug_model_tp2.toml"),
    # compiled: planned with torchtitan's compile, partitioned as inductor would, each graph holding what
    # inductor's own code of it holds (titan/runtime/peak_compile.py)
    "compiled, 1 rank": (1, ("--compile.enable",), None),
    "compiled, selective AC": (1, ("--compile.enable", "--activation_checkpoint", "selective"), None),
    "compiled, full AC": (1, ("--compile.enable", "--activation_checkpoint", "full"), None),
    "compiled, 2 FSDP2 ranks": (
        2,
        ("--compile.enable", "--parallelism.data_parallel_shard_degree", "2"),
        None,
    ),
    "compiled lean preset, 2 ranks": (2, ("--compile.enable",), LEAN),
    # the 8B one-GPU preset's twin: compiled, full AC, e4m3 saves, 4-bit states updated in the backward
    "one-GPU twin": (1, (), REPO / "train_configs" / "debug_one_gpu_twin.toml"),
    # the ~100M-parameter shape (titan/launch/bases.py llama3_100m: 88M), the debug model's recipe
    "100M, 1 rank": (1, (), M100),
    "100M, 2 FSDP2 ranks, selective AC": (
        2,
        ("--parallelism.data_parallel_shard_degree", "2", "--activation_checkpoint", "selective"),
        M100,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_planned_peak_is_within_ten_percent_of_the_allocators(tmp_path, case):
    nproc, args, config = CASES[case]
    if config is M100:
        config = write_toml(
            tmp_path / "100m.toml", job={"base": "low_bits_training.titan.launch.bases:llama3_100m"}
        )
    run = train(tmp_path, *SHAPE, *args, "--checkpoint.no-enable", nproc=nproc, config=config)
    got = json.loads((run.folder / PEAK_JSON).read_text())
    planned, measured = got["planned"]["later_steps"], got["measured"]["peak"]
    assert got["measured"]["step"] == 2 and got["planned"]["ranks"] == nproc
    assert abs(measured / planned - 1) <= 0.10, (case, planned, measured, got)
    assert "low-bits-training: memory: " in run.log and "GiB on rank 0" in run.log


def _fresh_python(code: str) -> list[str]:
    """The lines ``code`` prints, run in a new interpreter from the repository (exit status 0 asserted): the
    planner refuses a process whose process group or autograd already ran, as a test process's may have."""
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout.strip().splitlines()


def test_on_a_gpu_node_the_plan_never_refuses_on_the_cpus_attention(tmp_path):
    # A GPU node as torchtitan sees it (no CPU adapter: device_type "cuda"), on this CPU machine. The forked
    # planner points its own copy of torchtitan at the CPU (cpu.repoint_at_cpu), where FlexAttention has no
    # backward: the run is not planned, says why, and is not refused; the launcher keeps "cuda".
    code = (
        "import torch\ntorch.accelerator.is_available = lambda: True\n"
        "import low_bits_training.titan\nimport torchtitan.tools.utils as u\n"
        "from low_bits_training.titan.launch.worker import build_config\n"
        "from low_bits_training.titan.launch.memory import check_peak\n"
        f"c = build_config(['--config-file', 'train_configs/debug_model.toml', '--dump_folder', '{tmp_path}', "
        f"'--dataloader.dataset_path', '{CORPUS}'])\n"
        "found = check_peak(c, 1)\n"
        "print(u.device_type, found.plan is None, found.why_not.splitlines()[0])\n"
    )
    assert _fresh_python(code)[-1] == (
        "cuda True the planner failed: NotImplementedError: FlexAttention does not support backward on CPU. "
        "Please set the input requires_grad to False or use another device."
    )


def test_a_recipe_whose_cast_reads_values_is_planned(tmp_path):
    # nvfp4's wgrad RHT draws its sign vector from random bits it reads as numbers: on fake tensors that raised
    # DataDependentOutputException and no nvfp4 run was planned. The signs are now drawn on real tensors.
    code = (
        "from low_bits_training.titan.launch.worker import build_config\n"
        "from low_bits_training.titan.launch.validate import model_as_trained\n"
        "from low_bits_training.titan.runtime.peak import plan_peak\n"
        "for r in ('bf16', 'nvfp4'):\n"
        f"    c = build_config(['--config-file', 'train_configs/debug_model.toml', '--dump_folder', '{tmp_path}', "
        f"'--dataloader.dataset_path', '{CORPUS}', '--quantize.recipe', r])\n"
        "    p = plan_peak(c, 1, 'cpu', model_as_trained)\n"
        "    print(r, p.parts['forward and backward'])\n"
    )
    got = dict(line.split() for line in _fresh_python(code)[-2:])
    # nvfp4 keeps its rotated and quantized operands beside the bf16 ones: more held in the forward and backward
    assert int(got["nvfp4"]) > int(got["bf16"]) > 0, got
