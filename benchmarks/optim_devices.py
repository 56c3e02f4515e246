"""LowBitAdamW on two devices from the same start: does CUDA's update give the CPU's bits?

For each state setting (the defaults, the in_backward launcher test's stochastic-rounding group, 4-bit
moments) and each update (fused: compiled; eager: the reference), three steps of one 1024 x 1024 fp32
parameter with the same gradients on both devices; prints, per row, whether the parameter and every state
tensor are equal bit for bit, and the largest difference in fp32 ulps of the parameter. Without CUDA it
compares the CPU with itself (every row equal: the script's own check).

    python benchmarks/optim_devices.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from low_bits_training.optim import LowBitAdamW  # noqa: E402

BASE = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
SETTINGS = {
    "defaults": {},
    "int8 sr m, e4m3 v, bf16 master sr": {
        "exp_avg": "int8_block128_sr",
        "exp_avg_sq": "e4m3_block128",
        "master_weights": "bf16",
        "master_rounding": "stochastic",
    },
    "4-bit moments": {"exp_avg": "int4_block128", "exp_avg_sq": "e2m1_block128"},
}


def run(device: str, kwargs: dict, steps: int = 3) -> tuple[torch.Tensor, dict]:
    g = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(1024, 1024, generator=g).to(device))
    opt = LowBitAdamW([p], **BASE, **kwargs)
    for _ in range(steps):
        p.grad = torch.randn(1024, 1024, generator=g).to(device)
        opt.step()
    state = {k: v.detach().cpu() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
    return p.detach().cpu(), state


def compare(kwargs: dict, devices: tuple[str, str]) -> dict:
    (pa, sa), (pb, sb) = (run(d, kwargs) for d in devices)
    ulps = (pa.view(torch.int32).long() - pb.view(torch.int32).long()).abs().max().item()
    states = {k: torch.equal(sa[k], sb[k]) for k in sa}
    return {"param_equal": torch.equal(pa, pb), "param_max_ulps": ulps, "states_equal": states}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu", "cpu")
    print(f"torch {torch.__version__}: {devices[1]} against {devices[0]}")
    print("| setting | update | parameter | max ulps | states equal |")
    print("|---|---|---|---|---|")
    rows = {}
    for name, kw in SETTINGS.items():
        for fused in (True, False):
            r = rows[f"{name}, {'fused' if fused else 'eager'}"] = compare({**kw, "fused": fused}, devices)
            same = ", ".join(k for k, v in r["states_equal"].items() if v) or "none"
            differ = ", ".join(k for k, v in r["states_equal"].items() if not v)
            cell = "all" if not differ else f"{same} (differ: {differ})"
            eq = "equal" if r["param_equal"] else "differs"
            print(f"| {name} | {'fused' if fused else 'eager'} | {eq} | {r['param_max_ulps']} | {cell} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
