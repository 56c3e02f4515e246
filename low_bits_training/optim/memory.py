"""Memory as torch's allocator hands it out: the peak while a function runs (what an optimizer step costs),
and what spans of work still hold when they end (``HeldBytes``: what a module keeps for its backward).

On CUDA this is ``torch.cuda.max_memory_allocated``. The CPU allocator keeps no statistics, but it reports every
allocation and free to the profiler (``profile_memory=True``); the running sum of those events gives the
peak. Python objects and compiler work (torch.compile's first call) are not tensor allocations and are not
counted: the process's peak RSS shows those (benchmarks/bench_optim.py reports both).
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from low_bits_training.upstream import TorchDispatchMode


def allocated_peak(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Bytes allocated at the peak while ``fn()`` runs, above what was allocated when it started.

    Args:
        fn: the work to measure (e.g. ``opt.step``).
        device: where its tensors live ("cpu" or a CUDA device).

    Returns:
        The peak of (bytes allocated - bytes freed) over the call, >= 0.
    """
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return _running_peak(prof.profiler.kineto_results.events())


def _running_peak(events) -> int:
    """The largest running sum of the profiler's CPU allocation (+) and free (-) events, in time order."""
    now = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU:
            now += e.nbytes()
            peak = max(peak, now)
    return peak


class HeldBytes:
    """What the allocator handed out inside named spans of work and still held when each span ended, less
    the span's output: what a module's forward keeps for its backward, as the allocator sees it.

    On CUDA ``torch.cuda.memory_allocated`` before and after each span; on the CPU the profiler's allocation
    and free events (``profile_memory=True``) over ``recording()``, each span a ``record_function`` range
    inside it, less the events inside ranges named ``exclude`` (prefixes: ``"FSDP::"`` leaves out FSDP2's
    parameter all-gathers, whose buffer a block frees only in the next block's call). A span entered several
    times (microbatches) adds up.
    """

    PREFIX = "lbt_held::"

    def __init__(self, device: torch.device | str = "cpu", exclude: tuple[str, ...] = ()):
        self.device = torch.device(device)
        self.exclude = exclude
        self.net: dict[str, int] = {}
        self.outputs: dict[str, int] = {}
        self.start = 0
        """Bytes of tensors alive when ``recording`` began (``live_tensor_bytes``)."""
        self.peak = 0
        """The most bytes allocated at once during ``recording``, above ``start`` (no span excluded)."""

    @contextlib.contextmanager
    def recording(self):
        """Around all the spans (a training step): the figures start from zero."""
        self.net, self.outputs = {}, {}
        self.start = live_tensor_bytes(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            yield self
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.start
            return
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield self
        events = list(prof.profiler.kineto_results.events())
        self.peak = _running_peak(events)
        skip = sorted(
            (e.start_ns(), e.end_ns()) for e in events if self.exclude and e.name().startswith(self.exclude)
        )
        starts, ends = [a for a, _ in skip], list(itertools.accumulate((b for _, b in skip), max))

        def skipped(ns: int) -> bool:  # inside some excluded range
            i = bisect.bisect_right(starts, ns)
            return i > 0 and ends[i - 1] >= ns

        mem = sorted(
            (e.start_ns(), e.nbytes())
            for e in events
            if e.name() == "[memory]"
            and e.device_type() == torch.autograd.DeviceType.CPU
            and not skipped(e.start_ns())
        )
        times, total = [t for t, _ in mem], list(itertools.accumulate(n for _, n in mem))

        def upto(ns: int) -> int:  # bytes allocated - freed by the events at or before ns
            i = bisect.bisect_right(times, ns)
            return total[i - 1] if i else 0

        for e in events:
            if e.name().startswith(self.PREFIX):
                name = e.name()[len(self.PREFIX) :]
                self.net[name] = self.net.get(name, 0) + upto(e.end_ns()) - upto(e.start_ns())

    @contextlib.contextmanager
    def span(self, name: str):
        """One span of work named ``name``."""
        if self.device.type == "cuda":
            before = torch.cuda.memory_allocated(self.device)
            yield
            self.net[name] = self.net.get(name, 0) + torch.cuda.memory_allocated(self.device) - before
            return
        with record_function(self.PREFIX + name):
            yield

    def output(self, name: str, out) -> None:
        """What span ``name`` returned: its tensors' distinct storages are not counted as held."""
        storages = {}
        todo = [out]
        while todo:
            t = todo.pop()
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                storages[s.data_ptr()] = s.nbytes()
            elif isinstance(t, (tuple, list)):
                todo.extend(t)
            elif isinstance(t, dict):
                todo.extend(t.values())
        self.outputs[name] = self.outputs.get(name, 0) + sum(storages.values())

    def held(self) -> dict[str, int]:
        """Span name -> bytes allocated inside it and held at its end, less its output (after ``recording``)."""
        return {name: net - self.outputs.get(name, 0) for name, net in self.net.items()}


def inner_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors that hold ``t``: itself, or a tensor subclass's inner tensors (DTensor's local shard,
    torchao's codes / scale / qmap), found through ``__tensor_flatten__``."""
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [
        s for n in names if isinstance(inner := getattr(t, n), torch.Tensor) for s in inner_tensors(inner)
    ]


def storages_of(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The storages of ``inner_tensors(t)``."""
    return [x.untyped_storage() for x in inner_tensors(t)]


def _tensors(out) -> list[torch.Tensor]:
    """The tensors in an op's output (a tensor, or tuples / lists of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, tuple | list):
        return [t for o in out for t in _tensors(o)]
    return []


class LiveStorages(TorchDispatchMode):
    """An allocator's count run on tensors with no memory (``FakeTensorMode``): every storage an op makes is
    counted from the op that makes it until the last reference to it goes, tagged with the ``part`` it
    belongs to (the ``phase`` when it was made unless ``add`` names one), and the peak is kept with the parts
    live at that moment.

    Each storage counts ``nbytes`` rounded up to ``round_to`` bytes (512 on CUDA, as its caching allocator
    hands out blocks; 1 on the CPU). A storage is counted once however many tensors view it; tensor
    subclasses by their inner tensors. ``UntypedStorage.resize_`` (FSDP2 frees its all-gather buffers this
    way) is followed while the count runs. ``staging(func, args)``, when set, gives the bytes an op makes and
    frees inside itself beyond its outputs (gloo's collectives stage a whole tensor: ``cpu.gloo_staging``)."""

    def __init__(self, round_to: int = 1):
        super().__init__()
        self.round_to = round_to
        self.phase = "other"
        """The part a storage made now belongs to (set by the caller: forward and backward, optimizer)."""
        self.now = self.peak = 0
        self.peak_phase = self.phase
        self._live: dict[int, list] = {}  # id -> [bytes, part]
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._at_peak: list[list] = []
        self._resize = None
        self.staging: Callable[[Any, tuple], int] | None = None  # bytes an op makes and frees inside itself

    def _bytes(self, n: int) -> int:
        return -(-n // self.round_to) * self.round_to

    def add(self, t: torch.Tensor, part: str | None = None) -> None:
        """Count ``t``'s storages (made before the count started, or to retag one with ``part``)."""
        for st in storages_of(t):
            info = self._seen.get(st)
            if info is not None:
                info[1] = part or info[1]
                continue
            info = [self._bytes(st.nbytes()), part or self.phase]
            self._seen[st] = info
            self._live[id(info)] = info
            weakref.finalize(st, self._free, info)
            self._grow(info[0])

    def _grow(self, n: int) -> None:
        self.now += n
        if self.now > self.peak:
            self.peak, self.peak_phase = self.now, self.phase
            self._at_peak = list(self._live.values())
            self._peak_bytes = [i[0] for i in self._at_peak]

    def _free(self, info: list) -> None:
        if self._live.pop(id(info), None) is not None:
            self.now -= info[0]

    def transient(self, nbytes: int, part: str) -> None:
        """Count ``nbytes`` made and freed at once, as ``part`` (what an update makes while it runs, planned
        without values to run it on)."""
        info = [self._bytes(nbytes), part]
        self._live[id(info)] = info
        self._grow(info[0])
        self._free(info)

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak, self.peak_phase = -1, self.phase
        self._grow(0)

    def parts(self) -> dict[str, int]:
        """Part -> bytes live at the peak (a part's tag as it is now: ``add`` may retag after the peak)."""
        out: dict[str, int] = {}
        for info, n in zip(self._at_peak, self._peak_bytes, strict=True):
            out[info[1]] = out.get(info[1], 0) + n
        return out

    def __enter__(self):
        self._resize = torch.UntypedStorage.resize_
        original = self._resize

        def resize_(st, size):
            original(st, size)
            info = self._seen.get(st)
            if info is not None and info[0] != self._bytes(st.nbytes()):
                new = self._bytes(st.nbytes())
                if id(info) in self._live:
                    self.now -= info[0]
                    info[0] = new
                    self._grow(new)
                else:
                    info[0] = new

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.staging is not None and (n := self.staging(func, args)):
            self.transient(n, self.phase)
        out = func(*args, **(kwargs or {}))
        for t in _tensors(out):
            self.add(t)
        return out


def live_tensor_bytes(device: torch.device | str = "cpu") -> int:
    """Bytes of every tensor storage alive in this process on ``device`` (on CUDA: what the allocator holds,
    ``torch.cuda.memory_allocated``; on the CPU, each distinct storage of the tensors Python can reach, found
    through the garbage collector)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if not issubclass(type(obj), torch.Tensor):  # type(): a dead weakref.proxy raises on isinstance
            continue
        try:
            for st in storages_of(obj):
                if st.device.type == device.type and st.nbytes():
                    seen[st.data_ptr()] = st.nbytes()
        except (RuntimeError, NotImplementedError, AssertionError):  # a tensor without storage (meta, sparse)
            continue
    return sum(seen.values())
