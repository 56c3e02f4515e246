"""optim/memory.py's HeldBytes: what spans of work leave allocated, as the CPU allocator reports it."""

from __future__ import annotations

import torch
from torch.profiler import record_function

from low_bits_training.optim.memory import HeldBytes

KEEP = []


def _work(n: int, out: int, excluded: int = 0):
    """Allocate a temporary (freed), a kept tensor of n fp32 elements, an output of out elements, and
    (inside an 'FSDP::' range) a kept tensor of ``excluded`` elements."""
    tmp = torch.ones(4 * n)  # freed at return
    KEEP.append(torch.full((n,), 2.0) + tmp[:n])  # a new tensor (the add), held after the span
    if excluded:
        with record_function("FSDP::all_gather"):
            KEEP.append(torch.zeros(excluded))
    return torch.zeros(out), 3


def test_held_bytes_count_what_a_span_keeps_less_its_output_and_excluded_ranges():
    KEEP.clear()
    meter = HeldBytes("cpu", exclude=("FSDP::",))
    outs = []  # held: a span that freed an earlier output would count it
    with meter.recording():
        with meter.span("a"):
            outs.append(_work(1000, 300))
        meter.output("a", outs[-1])
        for _ in range(2):  # a span entered twice adds up (microbatches)
            with meter.span("b"):
                outs.append(_work(500, 0, excluded=2000))
            meter.output("b", outs[-1])
    assert meter.held() == {"a": 4000, "b": 2 * 2000}
    KEEP.clear()
    with meter.recording():  # starts from zero
        with meter.span("a"):
            out = _work(10, 10)
        meter.output("a", out)
    assert meter.held() == {"a": 40}
    KEEP.clear()
