"""Optimizer-state bytes per parameter, peak memory of a step and step time, per optimizer option.

Run: OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_optim.py [--quick] [--steps 10] [--ranks 2]
Or: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_optim.py --direction 300: the relative error of the update
direction m / sqrt(v) when the moments of a real loss go through each state format (``direction_errors``).
Or: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_optim.py --speed 7: the step time of LowBitAdamW's
fused and eager step, torch's AdamW (foreach, fused) and the peers that run here (torchao AdamW8bit / AdamW4bit /
AdamWFp8; bitsandbytes AdamW8bit and torch-optimi AdamW when installed) on 12 large tensors and on two
transformers' parameter mixes, all in one process, repeats interleaved, medians (``step_times``).
Or: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_optim.py --probe 1500 --seeds 0: the excess loss of a
regression probe against fp32 AdamW's, per state format (``probe_gaps``).
The weights: a stack of square fp32 matrices, 12 x 2048^2 = 50.3M parameters (--quick: 4 x 1024^2 = 4.2M),
with gradients; with --ranks 2, the same weights as FSDP2-sharded linear layers on 2 CPU ranks (gloo, one
thread each), figures per rank (the shards are equal).

Each option runs in two fresh processes with their own inductor cache. The first times every step (the first
one creates the states and compiles) and reads the process's RSS above parameters + gradients (torch.compile
warmed on a trivial function first, the C heap trimmed): the peak during step 1 (states, temporaries, the compiler's own memory), the RSS
after it (states plus what the compiler and the allocator keep) and the peak of the later steps. The second
reads the peak that torch's allocator hands out during step 1 and step 2 (``optim.memory.allocated_peak``:
the memory profiler on CPU): tensors only, the measure the bound is about. Step-time ratios are given for
the median and for the fastest of the later steps (on a shared machine the fastest is the least disturbed;
torch's AdamW, which allocates 192 MiB of temporaries a step at 50.3M, varies most from step to step).
Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

BOUND_MIB = 64
"""docs/optimizers.md: our options peak at most state bytes + this above parameters + gradients."""
OPTIONS: dict[str, tuple[str, dict]] = {
    "torch AdamW fp32 (foreach)": ("AdamW", {}),
    "LowBitAdamW bf16/bf16": ("LowBitAdamW", {"exp_avg": "bf16", "exp_avg_sq": "bf16"}),
    "LowBitAdamW defaults (int8/int8 sqrt(v) block128)": ("LowBitAdamW", {}),
    "LowBitAdamW int8/e4m3 block128": ("LowBitAdamW", {"exp_avg_sq": "e4m3_block128"}),
    "LowBitAdamW int8/e4m3 block128, eager": ("LowBitAdamW", {"exp_avg_sq": "e4m3_block128", "fused": False}),
    "LowBitAdamW int4/e2m1 block128": (
        "LowBitAdamW",
        {"exp_avg": "int4_block128", "exp_avg_sq": "e2m1_block128"},
    ),
    "LowBitAdamW e2m1/int4 block128 (the 4-bit presets')": (
        "LowBitAdamW",
        {"exp_avg": "e2m1_block128", "exp_avg_sq": "int4_block128"},
    ),
    "LowBitAdamW int4/e2m1 block32 e8m0": (
        "LowBitAdamW",
        {"exp_avg": "int4_block32_e8m0", "exp_avg_sq": "e2m1_block32_e8m0"},
    ),
    "LowBitAdamW int8/e4m3 + bf16 master Kahan": (
        "LowBitAdamW",
        {"exp_avg_sq": "e4m3_block128", "master_weights": "bf16", "master_rounding": "kahan"},
    ),
    "LowBitAdamW int8 sr/e4m3 + bf16 master SR": (
        "LowBitAdamW",
        {
            "exp_avg": "int8_block128_sr",
            "exp_avg_sq": "e4m3_block128",
            "master_weights": "bf16",
            "master_rounding": "stochastic",
        },
    ),
    "LowBitSGD int8 momentum": ("LowBitSGD", {"momentum_buffer": "int8_block128"}),
    "torchao AdamW8bit": ("AdamW8bit", {}),
    "torchao AdamW4bit": ("AdamW4bit", {}),
    "torchao AdamWFp8": ("AdamWFp8", {}),
}
TARGETS = {
    "LowBitAdamW bf16/bf16": (1.0, None),
    "LowBitAdamW int8/e4m3 block128": (1.5, "torchao AdamW8bit"),
    "LowBitAdamW int4/e2m1 block128": (1.5, "torchao AdamW4bit"),
}
"""Step-time aims (issue 12): at most this many times fp32 AdamW, and no slower than this torchao optimizer."""


def _trim() -> None:
    """Hand the C heap's free memory back to the OS (glibc), so that the RSS baseline is what is in use."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) for x in f if x.startswith("VmRSS")) / 1024


def _state_bytes(opt) -> int:
    """Bytes of this rank's optimizer-state tensors except the step counters (``optim.live_bytes.live_bytes``:
    subclasses by their parts, each storage once)."""
    from low_bits_training.optim.live_bytes import live_bytes

    held = live_bytes([], opt.state.values()).nbytes
    return sum(b for state, b in held.items() if state != "step")


def _params(quick: bool, ranks: int):
    """(params, names): fp32 weights with gradients; FSDP2-sharded linear layers when ``ranks`` > 1."""
    import torch

    torch.manual_seed(0)
    n, d = (4, 1024) if quick else (12, 2048)
    if ranks == 1:
        params = [torch.randn(d, d).requires_grad_() for _ in range(n)]
        for p in params:
            p.grad = torch.randn_like(p).mul_(1e-3)
        return params, [f"w{i}" for i in range(n)]
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, init_device_mesh

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False) for _ in range(n)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    names, params = zip(*model.named_parameters(), strict=True)
    for p in params:
        p.grad = DTensor.from_local(torch.randn_like(p.to_local()).mul_(1e-3), mesh, p.placements)
    return list(params), list(names)


def _build(name: str, extra: dict, params, names):
    import torch

    kw = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
    if name == "AdamW":
        return torch.optim.AdamW(params, **kw, foreach=True)
    if name.startswith("LowBit"):
        from low_bits_training.optim import OPTIMIZERS

        if name == "LowBitSGD":
            kw = {"lr": 1e-2, "momentum": 0.9, "weight_decay": 0.1}
        return OPTIMIZERS[name]([{"params": params, "param_names": names}], **kw, **extra)
    import torchao.optim

    return getattr(torchao.optim, name)(params, **kw)


def child(label: str, quick: bool, steps: int, ranks: int, mode: str) -> dict:
    """Measure one option in this process (one rank of ``ranks``): "time" (step times, peak RSS) or "alloc"
    (the allocator's peaks of steps 1 and 2, under the memory profiler, which costs time and memory itself)."""
    import torch

    from low_bits_training.optim.memory import allocated_peak
    from low_bits_training.titan.platform.cpu import _peak_rss_bytes, _reset_peak_rss

    params, names = _params(quick, ranks)
    numel = sum(p.to_local().numel() if ranks > 1 else p.numel() for p in params)
    opt = _build(*OPTIONS[label], params, names)
    out = {"label": label, "params": numel}
    if mode == "alloc":
        mib = 2.0**-20
        out["alloc1_mib"], out["alloc2_mib"] = allocated_peak(opt.step) * mib, allocated_peak(opt.step) * mib
        out["state_mib"], out["bytes_per_param"] = _state_bytes(opt) * mib, _state_bytes(opt) / numel
        return out
    # Warm torch.compile (its modules and caches, ~35 MiB, paid by any compiled run) with a trivial function,
    # so that the step-1 RSS shows what compiling this optimizer costs on top.
    torch.compile(lambda x: x * 2)(torch.ones(8))
    _trim()
    base = _rss_mib()
    _reset_peak_rss()
    times = []
    for k in range(steps):
        t = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t)
        if k == 0:  # step 1 (states created, kernels compiled) apart from the steady state after it
            out["rss1_mib"], out["rss_after1_mib"] = _peak_rss_bytes() / 2**20 - base, _rss_mib() - base
            _reset_peak_rss()
    out["rss_mib"] = _peak_rss_bytes() / 2**20 - base
    out.update(first_s=times[0], step_s=statistics.median(times[1:]), min_s=min(times[1:]))
    return out


def _command(label: str, quick: bool, steps: int, ranks: int, mode: str) -> list[str]:
    args = [__file__, "--child", label, "--mode", mode, "--steps", str(steps), "--ranks", str(ranks)]
    args += ["--quick"] * quick
    if ranks == 1:
        return [sys.executable, *args]
    run = ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--rdzv_backend=c10d"]
    return [sys.executable, *run, "--rdzv_endpoint=localhost:0", "--local-ranks-filter=0", *args]


def _measure(label: str, quick: bool, steps: int, ranks: int, mode: str, env: dict) -> dict | None:
    p = subprocess.run(_command(label, quick, steps, ranks, mode), env=env, capture_output=True, text=True)
    rows = [ln for ln in p.stdout.splitlines() if '{"label"' in ln]  # torchrun may prefix "[rank0]:"
    if p.returncode or not rows:
        print(f"{label} ({mode}) failed:\n{(p.stdout + p.stderr)[-2000:]}", file=sys.stderr)
        return None
    return json.loads(rows[-1][rows[-1].index("{") :])


def run_all(labels: list[str], quick: bool, steps: int, ranks: int) -> list[dict]:
    """Each option in two fresh processes: timing + peak RSS first (a cold compile), then allocator peaks."""
    out = []
    for label in labels:
        with tempfile.TemporaryDirectory(prefix="lbt-bench-inductor-") as cache:
            env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
            if ranks > 1:
                env["OMP_NUM_THREADS"] = "1"
            timed = _measure(label, quick, steps, ranks, "time", env)
            alloc = timed and _measure(label, quick, steps, ranks, "alloc", env)
        if alloc:
            out.append(timed | alloc)
    return out


def _meets(r: dict, by: dict, key: str) -> bool:
    most, rival = TARGETS[r["label"]]
    ok = r[key] <= most * by["torch AdamW fp32 (foreach)"][key]
    return ok and (rival not in by or r[key] <= by[rival][key])


def _aims(r: dict, by: dict) -> str:
    if r["label"] not in TARGETS or "torch AdamW fp32 (foreach)" not in by:
        return ""
    most, rival = TARGETS[r["label"]]
    verdict = lambda key: "yes" if _meets(r, by, key) else "NO"  # noqa: E731
    aim = f"<= {most}x" + (f", <= {rival.split()[-1]}" if rival else "")
    return f"{aim}: median {verdict('step_s')}, min {verdict('min_s')}"


def table(rows: list[dict]) -> str:
    by = {r["label"]: r for r in rows}
    ref = by.get("torch AdamW fp32 (foreach)")
    lines = [
        "| optimizer | state bytes/param | state (MiB) | allocator peak step 1 / 2 (MiB) | "
        f"step-1 allocator peak - state (aim <= {BOUND_MIB}) | RSS step-1 peak / after step 1 / later peak "
        "(MiB) | first step (s) | step median / min (s) | vs fp32 AdamW, median / min | aim |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        extra = r["alloc1_mib"] - r["state_mib"]
        mark = (" ok" if extra <= BOUND_MIB else " OVER") if r["label"].startswith("LowBit") else ""
        rel = f"{r['step_s'] / ref['step_s']:.2f}x / {r['min_s'] / ref['min_s']:.2f}x" if ref else "n/a"
        lines.append(
            f"| {r['label']} | {r['bytes_per_param']:.3f} | {r['state_mib']:.0f} | {r['alloc1_mib']:.0f} / "
            f"{r['alloc2_mib']:.0f} | {extra:.0f}{mark} | {r['rss1_mib']:.0f} / {r['rss_after1_mib']:.0f} / "
            f"{r['rss_mib']:.0f} | {r['first_s']:.2f} | {r['step_s']:.3f} / {r['min_s']:.3f} | {rel} | "
            f"{_aims(r, by)} |"
        )
    return "\n".join(lines)


DIRECTION_FORMATS: dict[str, dict] = {
    "int8_block128 / e4m3_block128 sqrt(v)": {"exp_avg_sq": "e4m3_block128"},
    "int8_block128 / int8_block128 sqrt(v)": {"exp_avg_sq": "int8_block128"},
    "dt8_block128 / udt8_block128 sqrt(v)": {"exp_avg": "dt8_block128", "exp_avg_sq": "udt8_block128"},
    "dt8_block256 / udt8_block256 sqrt(v)": {"exp_avg": "dt8_block256", "exp_avg_sq": "udt8_block256"},
    "dt8_block256 / udt8_block256 v (torchao's layout)": {
        "exp_avg": "dt8_block256",
        "exp_avg_sq": "udt8_block256",
        "sqrt_exp_avg_sq": False,
    },
    "dt8_block256 / int8_block128 sqrt(v)": {"exp_avg": "dt8_block256", "exp_avg_sq": "int8_block128"},
    "int8_block128 / udt8_block128 sqrt(v)": {"exp_avg_sq": "udt8_block128"},
    "int4_block128 / e2m1_block128 sqrt(v)": {"exp_avg": "int4_block128", "exp_avg_sq": "e2m1_block128"},
    "e2m1_block128 / e2m1_block128 sqrt(v)": {"exp_avg": "e2m1_block128", "exp_avg_sq": "e2m1_block128"},
    "e2m1_block128 / int4_block128 sqrt(v)": {"exp_avg": "e2m1_block128", "exp_avg_sq": "int4_block128"},
}
"""Update-direction rows: state formats of LowBitAdamW (``AdamWOptions`` keys; the rest its defaults)."""


def real_moments(steps: int) -> list[tuple]:
    """(m, v, step) of torch AdamW (fp32, betas 0.9 / 0.999) after ``steps`` steps of a teacher-student MLP
    (512 -> 2048 -> 512, GELU, batch 128, lr 1e-3, noisy targets): moments of a real loss, not random ones."""
    import torch

    torch.manual_seed(0)
    mlp = lambda: torch.nn.Sequential(  # noqa: E731
        torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)
    )
    teacher, student = mlp(), mlp()
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    for _ in range(steps):
        x = torch.randn(128, 512)
        with torch.no_grad():
            y = teacher(x) + 0.1 * torch.randn(128, 512)
        loss = torch.nn.functional.mse_loss(student(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [
        (s["exp_avg"], s["exp_avg_sq"], int(s["step"]))
        for p in student.parameters()
        if p.dim() == 2
        for s in [opt.state[p]]
    ]


def _state_round_trip(cm, cv, sqrt_v: bool):
    """(m, v) -> (m, v) as the optimizer stores and reads them back (v through sqrt(v) where ``sqrt_v``)."""

    def rt(codec, x):
        return codec.decode(codec.encode(x), tuple(x.shape))

    return lambda m, v: (rt(cm, m), rt(cv, v.sqrt()).square() if sqrt_v else rt(cv, v))


def direction_errors(steps: int) -> list[dict]:
    """Relative error ||u_q - u|| / ||u|| of the update direction u = m_hat / (sqrt(v_hat) + eps) when m and v
    go through each state format of ``DIRECTION_FORMATS`` (the optimizer's own codec; sqrt(v) squared back
    where stored; with and without the optimizer's ``v_floor``), over the 2-D weights of ``real_moments``;
    and torchao AdamW8bit's / AdamW4bit's quantizers as the peers (8-bit: signed dynamic map on m, unsigned on v,
    blocks of 256; 4-bit: signed 4-bit dynamic map on m, 16 even steps without 0 on v, blocks of 128)."""
    import torch
    from torchao.optim.quant_utils import (
        create_dynamic_map,
        dequant_with_qmap,
        quantize_4bit_with_qmap,
        quantize_8bit_with_qmap,
        scale_tensor,
    )

    from low_bits_training.optim import StateCodec
    from low_bits_training.optim.options import AdamWOptions

    b1, b2, eps = 0.9, 0.999, 1e-8
    moments = real_moments(steps)
    inv_c2 = ((1 - b2) * (1 - b1**2 / b2)) / (1 - b1) ** 2

    def direction(m, v, k):
        return (m / (1 - b1**k)) / ((v / (1 - b2**k)).sqrt() + eps)

    def torchao_peer(qmap_m, qmap_v, block, quantize):
        """(m, v) -> (m, v) through torchao's ``quantize`` with these maps, in blocks of ``block``."""

        def q(x, qmap):
            qmap = torch.tensor(qmap, dtype=torch.float32)
            scaled, scale = scale_tensor(x, block)
            return dequant_with_qmap(quantize(scaled, qmap), qmap, scale).view_as(x)

        return lambda m, v: (q(m, qmap_m), q(v, qmap_v))

    def row(label, quantize, floor):
        num = den = flushed = n = 0.0
        for m, v, k in moments:
            u = direction(m, v, k)
            mq, vq = quantize(m, v)
            uq = direction(mq, torch.maximum(vq, mq * mq * inv_c2) if floor else vq, k)
            num, den = num + (uq - u).pow(2).sum().item(), den + u.pow(2).sum().item()
            flushed, n = flushed + ((mq == 0) & (m != 0)).sum().item(), n + m.numel()
        return {"label": label, "floor": floor, "err": (num / den) ** 0.5, "flushed": flushed / n}

    rows = []
    for label, kw in DIRECTION_FORMATS.items():
        o = AdamWOptions(lr=1.0, betas=(b1, b2), eps=eps, **kw)
        specs = o.state_specs()
        q = _state_round_trip(
            StateCodec(specs["exp_avg"]), StateCodec(specs["exp_avg_sq"]), o.sqrt_exp_avg_sq
        )
        rows += [row(label, q, True), row(label, q, False)]
    peers = {  # label: (m's map, v's map, block, quantizer) of torchao's AdamW8bit / AdamW4bit
        "torchao AdamW8bit (dynamic map m / v, block 256)": (
            create_dynamic_map(True), create_dynamic_map(False), 256, quantize_8bit_with_qmap
        ),
        "torchao AdamW4bit (dynamic map m, linear no-zero v, block 128)": (
            create_dynamic_map(True, 3, 4), torch.linspace(0, 1, 17)[1:].tolist(), 128,
            quantize_4bit_with_qmap,
        ),
    }  # fmt: skip
    rows += [row(label, torchao_peer(*peer), False) for label, peer in peers.items()]
    return rows


def direction_table(rows: list[dict]) -> str:
    by: dict[str, dict] = {}
    for r in rows:
        by.setdefault(r["label"], {})[r["floor"]] = r
    lines = [
        "| m / v state formats | update-direction error, v_floor / no floor | m entries flushed to 0 |",
        "|---|---|---|",
    ]
    for label, r in by.items():
        err = " / ".join(f"{r[f]['err']:.4f}" if f in r else "n/a" for f in (True, False))
        lines.append(f"| {label} | {err} | {next(iter(r.values()))['flushed']:.2%} |")
    return "\n".join(lines)


PROBE_FORMATS: dict[str, dict] = {
    "int8_block128 / e4m3_block128 sqrt(v)": {"exp_avg_sq": "e4m3_block128"},
    "int8_block128 / int8_block128 sqrt(v)": {"exp_avg_sq": "int8_block128"},
    "int8_block128 / udt8_block128 sqrt(v)": {"exp_avg_sq": "udt8_block128"},
    "dt8_block128 / udt8_block128 sqrt(v)": {"exp_avg": "dt8_block128", "exp_avg_sq": "udt8_block128"},
    "dt8_block256 / udt8_block256 sqrt(v)": {"exp_avg": "dt8_block256", "exp_avg_sq": "udt8_block256"},
    "int4_block128 / e2m1_block128 sqrt(v)": {"exp_avg": "int4_block128", "exp_avg_sq": "e2m1_block128"},
    "int4_block128 / int4_block128 sqrt(v)": {"exp_avg": "int4_block128", "exp_avg_sq": "int4_block128"},
    "e2m1_block128 / e2m1_block128 sqrt(v)": {"exp_avg": "e2m1_block128", "exp_avg_sq": "e2m1_block128"},
    "e2m1_block128 / int4_block128 sqrt(v)": {"exp_avg": "e2m1_block128", "exp_avg_sq": "int4_block128"},
}
"""Probe rows: LowBitAdamW state formats (``AdamWOptions`` keys; the rest its defaults)."""


def probe_loss(make_opt, steps: int, seed: int) -> float:
    """Excess held-out loss after ``steps`` steps of noisy linear regression (a 512 -> 512 student of a
    teacher, inputs whose scales span two decades, so Adam's preconditioning matters; batch 64, fp32 weights,
    lr 1e-2 with cosine decay to 1%, betas (0.9, 0.999)): a convex loss, so no chaotic divergence between runs,
    and late in the run the updates are far below the weights' size and the moments' precision decides how
    far it falls. The loss is the mean squared distance of the student's outputs to the teacher's on 4096
    held-out inputs; the same teacher, init, batches and held-out set (``seed``) for every optimizer."""
    import math

    import torch

    g = torch.Generator().manual_seed(seed)
    scales = torch.logspace(0, -2, 512)
    teacher = torch.randn(512, 512, generator=g) / 512**0.5
    student = torch.nn.Linear(512, 512, bias=False)
    with torch.no_grad():
        student.weight.copy_(torch.randn(512, 512, generator=g) / 512**0.5)
    x_eval = torch.randn(4096, 512, generator=g) * scales
    opt = make_opt(student)
    for k in range(steps):
        lr = 1e-2 * (0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * k / steps)))
        for group in opt.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        x = torch.randn(64, 512, generator=g) * scales
        y = x @ teacher.T + 0.1 * torch.randn(64, 512, generator=g)
        loss = torch.nn.functional.mse_loss(student(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return torch.nn.functional.mse_loss(student(x_eval), x_eval @ teacher.T).item()


def probe_gaps(steps: int, seeds: list[int], only: list[str] | None = None) -> list[dict]:
    """Per optimizer of ``PROBE_FORMATS`` (and torchao AdamW8bit / AdamW4bit), or those of them named in
    ``only``: the excess loss of ``probe_loss`` relative to fp32 torch AdamW's (always run) on the same seed, in
    %, for each of ``seeds``."""
    import torch
    import torchao.optim

    from low_bits_training.optim import LowBitAdamW

    kw = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}

    def lowbit(extra):
        def make(model):
            named = list(model.named_parameters())
            groups = [{"params": [p for _, p in named], "param_names": [n for n, _ in named]}]
            return LowBitAdamW(groups, **kw, **extra)

        return make

    makers = {"torch AdamW fp32": lambda m: torch.optim.AdamW(m.parameters(), **kw)}
    makers |= {label: lowbit(extra) for label, extra in PROBE_FORMATS.items()}
    for label, name in (
        ("torchao AdamW8bit (dynamic map m / v, block 256)", "AdamW8bit"),
        ("torchao AdamW4bit (dynamic map m, linear no-zero v, block 128)", "AdamW4bit"),
    ):
        cls = getattr(torchao.optim, name)
        makers[label] = lambda m, cls=cls: cls(m.parameters(), **(kw | {"lr": torch.tensor(kw["lr"])}))
    unknown = set(only or ()) - set(makers)
    if unknown:
        raise SystemExit(f"--only: unknown probe rows {sorted(unknown)}; rows: {list(makers)}")
    makers = {k: v for k, v in makers.items() if not only or k in only or k == "torch AdamW fp32"}
    losses = {label: [probe_loss(make, steps, s) for s in seeds] for label, make in makers.items()}
    ref = losses["torch AdamW fp32"]
    return [
        {"label": label, "loss": ls, "gap": [100 * (a / b - 1) for a, b in zip(ls, ref, strict=True)]}
        for label, ls in losses.items()
    ]


def probe_table(rows: list[dict]) -> str:
    lines = [
        "| optimizer | excess loss, mean | gap to fp32 AdamW, mean (min / max over seeds) |",
        "|---|---|---|",
    ]
    for r in rows:
        g = r["gap"]
        lines.append(
            f"| {r['label']} | {statistics.mean(r['loss']):.4g} | {statistics.mean(g):+.2f}% "
            f"({min(g):+.2f}% / {max(g):+.2f}%) |"
        )
    return "\n".join(lines)


def llama_shapes(dim: int, layers: int, ffn: int, vocab: int) -> list[tuple[int, ...]]:
    """Parameter shapes of a Llama (torchtitan's layout): embedding, per layer q / k / v / o, w1 / w2 / w3 and
    two RMSNorm weights, the final norm and the output projection."""
    per_layer = [(dim, dim)] * 4 + [(ffn, dim), (dim, ffn), (ffn, dim), (dim,), (dim,)]
    return [(vocab, dim), *per_layer * layers, (dim,), (vocab, dim)]


SPEED_MIXES: dict[str, list[tuple[int, ...]]] = {
    "12 x 2048^2 (50.3M)": [(2048, 2048)] * 12,
    "Llama dim 512, 8 layers, vocab 16000 (43.7M, 75 tensors)": llama_shapes(512, 8, 1536, 16000),
    "debug Llama dim 256, 6 layers, vocab 2048 (6.2M, 57 tensors)": llama_shapes(256, 6, 768, 2048),
}
"""Parameter mixes of ``--speed``: a few large tensors, and transformers' many small ones (norms)."""
SPEED_OPTIMIZERS: dict[str, tuple[str, dict]] = {
    "torch AdamW (foreach)": ("torch", {"foreach": True}),
    "torch AdamW (fused)": ("torch", {"fused": True}),
    "LowBitAdamW defaults (fused)": ("LowBitAdamW", {}),
    "LowBitAdamW defaults, batch_numel 64K (fused)": ("LowBitAdamW", {"batch_numel": 1 << 16}),
    "LowBitAdamW bf16/bf16 (fused)": ("LowBitAdamW", {"exp_avg": "bf16", "exp_avg_sq": "bf16"}),
    "LowBitAdamW 4-bit presets' e2m1 / int4 sqrt(v) (fused)": (
        "LowBitAdamW",
        {"exp_avg": "e2m1_block128", "exp_avg_sq": "int4_block128"},
    ),
    "LowBitAdamW bf16/bf16, batch_numel 64K (fused)": (
        "LowBitAdamW",
        {"exp_avg": "bf16", "exp_avg_sq": "bf16", "batch_numel": 1 << 16},
    ),
    "LowBitAdamW defaults, bf16 master SR, batch_numel 64K (fused)": (
        "LowBitAdamW",
        {"master_weights": "bf16", "master_rounding": "stochastic", "batch_numel": 1 << 16},
    ),
    "LowBitAdamW defaults (eager, fused=False)": ("LowBitAdamW", {"fused": False}),
    "torchao AdamW8bit": ("torchao", {"name": "AdamW8bit"}),
    "torchao AdamW4bit": ("torchao", {"name": "AdamW4bit"}),
    "torchao AdamWFp8": ("torchao", {"name": "AdamWFp8"}),
    "bitsandbytes AdamW8bit": ("bitsandbytes", {}),
    "torch-optimi AdamW": ("optimi", {}),
}
"""Optimizers of ``--speed`` (peers that are not installed or fail on this machine are left out, said so)."""


def _speed_opt(kind: str, extra: dict, params: list):
    import importlib

    import torch

    kw = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
    if kind == "torch":
        return torch.optim.AdamW(params, **kw, **extra)
    if kind == "LowBitAdamW":
        from low_bits_training.optim import LowBitAdamW

        names = [f"p{i}" for i in range(len(params))]
        return LowBitAdamW([{"params": params, "param_names": names}], **kw, **extra)
    if kind == "torchao":
        return getattr(importlib.import_module("torchao.optim"), extra["name"])(params, **kw)
    if kind == "bitsandbytes":
        return importlib.import_module("bitsandbytes").optim.AdamW8bit(params, **kw)
    return importlib.import_module("optimi").AdamW(params, **kw)


def step_times(
    shapes: list, repeats: int, labels: list[str] | None = None, warmup: int = 2
) -> tuple[dict[str, float], dict[str, str], dict]:
    """Median step time (s) of each ``SPEED_OPTIMIZERS`` entry on fp32 parameters of ``shapes`` (gradients
    randn * 1e-3), all in this process, the repeats interleaved (optimizer after optimizer, ``repeats`` times)
    so that a load on the machine falls on all alike. Every optimizer updates its own copy of the weights.
    Returns (label -> median seconds, label -> why it was left out, label -> first step's seconds)."""
    import torch

    g = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [torch.randn(s, generator=g).mul_(1e-3) for s in shapes]
    opts, skipped, first = {}, {}, {}
    for label in labels or list(SPEED_OPTIMIZERS):
        kind, extra = SPEED_OPTIMIZERS[label]
        params = [t.clone().requires_grad_() for t in init]
        for p, gr in zip(params, grads, strict=True):
            p.grad = gr  # shared: optimizers only read gradients
        try:
            opt = _speed_opt(kind, extra, params)
            t = time.perf_counter()
            opt.step()  # states created, kernels compiled
            first[label] = time.perf_counter() - t
            for _ in range(warmup - 1):
                opt.step()
        except Exception as e:  # noqa: BLE001 - a peer that is absent or does not run here is reported
            skipped[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
            continue
        opts[label] = opt
    times: dict[str, list[float]] = {label: [] for label in opts}
    for _ in range(repeats):
        for label, opt in opts.items():
            t = time.perf_counter()
            opt.step()
            times[label].append(time.perf_counter() - t)
    return {label: statistics.median(ts) for label, ts in times.items()}, skipped, first


def speed_table(results: dict[str, tuple[dict, dict]]) -> str:
    """Step time per optimizer and mix, as a ratio to torch foreach / fused AdamW measured alongside."""
    mixes = list(results)
    head = " | ".join(f"{m}: ms, vs foreach / vs fused (first step, s)" for m in mixes)
    lines = [f"| optimizer | {head} |", "|---|" + "---|" * len(mixes)]
    for label in SPEED_OPTIMIZERS:
        cells = []
        for m in mixes:
            med, skipped, first = results[m]
            if label not in med:
                cells.append(f"n/a ({skipped.get(label, 'not run')})")
                continue
            t = med[label]
            fe, fu = (med.get(f"torch AdamW ({k})") for k in ("foreach", "fused"))
            ratios = " / ".join(f"{t / ref:.2f}x" if ref else "n/a" for ref in (fe, fu))
            cells.append(f"{t * 1e3:.1f}, {ratios} ({first[label]:.1f})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 x 1024^2 params instead of 12 x 2048^2")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per option (the first one compiles)")
    ap.add_argument("--ranks", type=int, default=1, help="FSDP2 ranks (figures per rank)")
    ap.add_argument("--only", nargs="*", default=None, help="option labels to run (default: all)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="time", help=argparse.SUPPRESS)
    ap.add_argument(
        "--direction",
        type=int,
        default=0,
        metavar="STEPS",
        help="instead: the update-direction error of each state format on the moments of STEPS AdamW steps",
    )
    ap.add_argument(
        "--probe",
        type=int,
        default=0,
        metavar="STEPS",
        help="instead: the loss gap to fp32 AdamW of each state format on a STEPS-step regression probe",
    )
    ap.add_argument("--seeds", type=int, nargs="*", default=[0], help="seeds of --probe")
    ap.add_argument(
        "--speed",
        type=int,
        default=0,
        metavar="REPEATS",
        help="instead: step times against torch AdamW and the peers, all in one process, REPEATS interleaved",
    )
    ap.add_argument("--mixes", nargs="*", default=None, help="parameter mixes of --speed (default: all)")
    args = ap.parse_args()
    if args.speed:
        mixes = args.mixes or list(SPEED_MIXES)
        results = {m: step_times(SPEED_MIXES[m], args.speed, args.only) for m in mixes}
        threads = os.environ.get("OMP_NUM_THREADS", "unset")
        print(
            f"median of {args.speed} interleaved steps per optimizer, fp32 params, CPU, OMP_NUM_THREADS={threads}\n"
        )
        print(speed_table(results))
        return
    if args.probe:
        rows = probe_gaps(args.probe, args.seeds, args.only)
        print(f"probe_loss, {args.probe} steps, seeds {args.seeds}, CPU, one process\n")
        print(probe_table(rows))
        print(json.dumps(rows))
        return
    if args.direction:
        print(f"moments after {args.direction} AdamW steps (real_moments), CPU, one process\n")
        print(direction_table(direction_errors(args.direction)))
        return
    if args.child:
        print(json.dumps(child(args.child, args.quick, args.steps, args.ranks, args.mode)), flush=True)
        if args.ranks > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
        return
    rows = run_all(args.only or list(OPTIONS), args.quick, args.steps, args.ranks)
    n = rows[0]["params"] if rows else 0
    threads = "1 per rank" if args.ranks > 1 else os.environ.get("OMP_NUM_THREADS", "unset")
    where = f" per rank of {args.ranks} FSDP2 ranks" if args.ranks > 1 else ""
    print(
        f"{n / 1e6:.1f}M fp32 params{where}, {args.steps} steps per option, CPU, OMP_NUM_THREADS={threads}\n"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
