"""Compiled runs planned as inductor runs them (``titan/runtime/peak_compile.py``): the planner's backend saves
what inductor saves, runs under the count, and gives no bytes to what a fused kernel keeps in registers.
Held to the allocator through the launcher in ``test_peak.py`` (the compiled cases)."""

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from low_bits_training.optim.memory import allocated_peak
from low_bits_training.titan.platform import compat
from low_bits_training.titan.runtime import peak_compile


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(64, 256)
        self.down = torch.nn.Linear(256, 64)

    def forward(self, x):
        return self.down(F.silu(self.up(x)) * 2 + 1)


def _saved(backend, fake: bool) -> list[tuple]:
    """(shape, dtype) of every tensor autograd saves in one forward of ``Mlp`` compiled with ``backend``."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    with FakeTensorMode() if fake else torch.enable_grad():
        model = Mlp()
        model.compile(backend=backend, fullgraph=True)
        x = torch.randn(4, 32, 64, requires_grad=True)
        got = []
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: got.append((tuple(t.shape), t.dtype)) or t, lambda t: t
        ):
            model(x)
    return sorted(got, key=str)


def test_the_planners_backend_saves_what_inductor_saves():
    count = peak_compile.CompiledCount()
    ours = _saved(peak_compile.backend(count), fake=True)
    assert ours == _saved("inductor", fake=False)
    assert ours != _saved("eager", fake=False)  # eager saves silu's input as the linear made it: another set


def test_a_compiled_module_runs_under_the_count_and_fused_values_count_no_bytes():
    torch._dynamo.reset()
    with FakeTensorMode():
        count = peak_compile.CompiledCount()
        model = Mlp()
        model.compile(backend=peak_compile.backend(count), fullgraph=True)
        x = torch.randn(4, 32, 64, requires_grad=True)
        for t in (x, *model.parameters()):
            count.add(t, "before")  # as the planner adds parameters: a view of them is not a new storage
        with count:
            before = count.now
            y = model(x)
            after_forward, forward_peak = count.now - before, count.peak - before
            y.sum().backward()
    hidden, out = 4 * 32 * 256 * 4, 4 * 32 * 64 * 4
    # held after the forward: the output and what the partitioner saved (up's output and the mm input); silu's
    # value and its doubling live only inside the kernel that makes the mm input, so the forward never held more
    # (run op by op and counted, as torch's aot_eager_decomp_partition runs it: one hidden more at its peak)
    assert after_forward == out + 2 * hidden and forward_peak == after_forward
    assert count.peak - before < after_forward + 3 * hidden  # the backward: two hidden gradients at most


def test_fused_away_is_the_pointwise_chain_inside_one_kernel():
    def f(x, w):
        h = torch.exp(x) * 2  # exp's value is only read by the multiply: fused
        return (h + 1) @ w, x.sum()  # h + 1 feeds a matmul: written

    gm = make_fx(f)(torch.randn(8, 8), torch.randn(8, 8))
    fused = {n.name for n in peak_compile.fused_away(gm.graph)}
    assert fused == {"exp", "mul"}, fused


def _rotary(x, w, freqs):
    """A block's attention input as the debug model makes it: one matmul for q, k, v, a complex rotation of q and
    k (inductor calls aten's complex multiply: a fallback op with its own output) and one fused kernel after."""
    d = x.shape[-1]
    q, k, v = (x @ w).split(d, -1)

    def rotate(t):
        return torch.view_as_real(torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2)) * freqs)

    return rotate(q).flatten(-2).to(x.dtype) + v, rotate(k).flatten(-2).to(x.dtype) * v


def test_the_code_peak_is_what_the_allocator_holds_running_inductors_code():
    torch._dynamo.reset()
    x, w = torch.randn(4, 64, 32, dtype=torch.bfloat16), torch.randn(32, 96, dtype=torch.bfloat16)
    freqs = torch.polar(torch.ones(64, 16), torch.randn(64, 16))
    code = []

    def run(gm, example_inputs, is_backward):
        code.append(compat.inductor_code(gm, example_inputs, is_backward))
        return lambda args: torch.fx.Interpreter(gm).boxed_run(args)

    with torch.no_grad():
        torch.compile(_rotary, backend=compat.partitioned_backend(run), fullgraph=True)(x, w, freqs)
        torch._dynamo.reset()
        compiled = torch.compile(_rotary, backend="inductor", fullgraph=True)
        compiled(x, w, freqs)
        measured = allocated_peak(lambda: compiled(x, w, freqs))
    (only,) = code
    planned = peak_compile.code_peak(only)
    # qkv (bf16), both complex products (fp32 pairs) and both outputs: more than a node-by-node run holds
    assert planned == measured, (planned, measured)
    assert planned >= 4 * 64 * 96 * 2 + 2 * 4 * 64 * 32 * 4
