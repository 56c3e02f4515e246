"""[profiling] tells the truth: the FLOP table counts attention, the CPU memory timeline says CPU, the trace
spans carry the training step numbers (unit checks, then the profiling preset trained for real)."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from helpers import REPO, train
from low_bits_training.errors import ConfigError
from low_bits_training.titan.runtime import profiling


def _attention(B=2, N=4, L=64, H=16):
    q, k, v = (torch.randn(B, N, L, H, requires_grad=True) for _ in range(3))  # (B, N, L, H)
    mask = torch.ones(B, 1, L, L, dtype=torch.bool).tril()
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.sum().backward()


def test_flop_table_counts_cpu_attention_forward_and_backward(tmp_path):
    with profiling.flop_table(str(tmp_path), step=3, depth=1):
        _attention()
    data = json.loads(next((tmp_path / profiling.FLOPS_DIR).glob("step_3_rank0.json")).read_text())
    shape = (2, 4, 64, 16)
    expected = sdpa_flop_count(shape, shape, shape) + sdpa_backward_flop_count(shape, shape, shape, shape)
    assert data["total"] == expected  # torch's own SDPA formulas, as it counts the CUDA kernels
    table = next((tmp_path / profiling.FLOPS_DIR).glob("step_3_rank0.txt")).read_text()
    assert "_scaled_dot_product_flash_attention_for_cpu" in table


def _text(html: str) -> str:
    """The page without its embedded PNG (base64 data may spell any word by chance, "GPU" included)."""
    start = html.index("base64,") + len("base64,")
    return html[:start] + html[html.index("'", start) :]


def test_cpu_memory_timeline_is_titled_cpu(tmp_path):
    lin = torch.nn.Linear(64, 64)
    with profiling.memory_timeline(str(tmp_path), step=7):
        lin(torch.randn(32, 64)).sum().backward()
    html = next((tmp_path / profiling.TIMELINE_DIR).glob("step_7_rank0.html")).read_text()
    assert "<title>CPU memory timeline, step 7, rank 0 (peak " in html and "GPU" not in _text(html)
    times, sizes = json.loads(next((tmp_path / profiling.TIMELINE_DIR).glob("step_7_rank0.json")).read_text())
    assert len(times) == len(sizes) > 0 and len(sizes[0]) == 1 + len(profiling.memory_categories())


def test_step_span_only_while_a_profiler_records(tmp_path):
    cfg = profiling.ProfilingConfig()
    with torch.profiler.profile() as prof:
        with profiling.step_context(cfg, str(tmp_path), 12):
            torch.ones(4).sum()
    assert "train_step 12" in {e.name for e in prof.events()}
    stack = profiling.step_context(cfg, str(tmp_path), 13)
    assert not stack._exit_callbacks  # no profiler: nothing entered


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"flop_table_step": -1}, "profiling.flop_table_step = -1: expected an int >= 0 (0: off)"),
        ({"flop_table_depth": 0}, "profiling.flop_table_depth = 0: expected an int >= 1"),
        ({"memory_timeline_step": "3"}, "profiling.memory_timeline_step = '3' (str): expected int"),
    ],
)
def test_profiling_section_is_checked_when_built(kwargs, message):
    with pytest.raises(ConfigError) as e:
        profiling.ProfilingConfig(**kwargs)
    assert str(e.value) == message


def test_profiling_preset_trace_steps_flops_and_timeline(tmp_path):
    run = train(
        tmp_path,
        "--training.steps", "7", "--profiling.memory_timeline_step", "7",
        config=REPO / "train_configs" / "debug_model_profiling.toml",
    )  # fmt: skip
    prof = run.folder / "profiling"
    trace = next((prof / "traces").rglob("rank0_trace.json*"))
    opener = gzip.open if trace.suffix == ".gz" else open
    with opener(trace, "rt") as f:
        names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
    assert {"train_step 4", "train_step 5"} <= names  # the preset's trace window, by training step
    flops = json.loads((prof / "flops" / "step_3_rank0.json").read_text())
    table = (prof / "flops" / "step_3_rank0.txt").read_text()
    assert flops["total"] > 0 and "_scaled_dot_product_flash_attention_for_cpu" in table
    html = (prof / "memory_timeline" / "step_7_rank0.html").read_text()
    assert "CPU memory timeline, step 7" in html and "GPU" not in _text(html)
