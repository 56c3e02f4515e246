"""Compare two sets of run folders recorded by ``scripts/record_presets.sh``: per preset, the losses and
gradient norms of every logged step (``metrics.jsonl``), the plan files (``precision_plan.*``,
``precision_schedule.json``, ``gemm_sizes.json``, ``state_bytes.json``) byte for byte, and every tensor of
every checkpoint (read with torch's DCP, compared by a hash of its bytes). One line per preset; exit code 1
when any differs or is missing.

    .venv/bin/python scripts/compare_runs.py BEFORE AFTER
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

PLAN_FILES = (
    "precision_plan.txt",
    "precision_plan.json",
    "precision_schedule.json",
    "gemm_sizes.json",
    "state_bytes.json",
)


def losses(run: Path) -> dict:
    """(file, step) -> the loss and gradient-norm figures of that logged row."""
    out = {}
    for f in sorted(run.rglob("metrics*.jsonl")):
        for line in f.read_text().splitlines():
            row = json.loads(line)
            out[(f.name, row.get("step"))] = {k: v for k, v in row.items() if "loss" in k or "grad_norm" in k}
    return out


def checkpoints(run: Path) -> dict:
    """step folder -> tensor key -> sha256 of its bytes."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    out = {}
    for step in sorted((run / "checkpoint").glob("step-*")):
        meta = FileSystemReader(str(step)).read_metadata()
        state = {
            k: torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in meta.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)
        }
        dcp.load(state, checkpoint_id=str(step), no_dist=True)
        out[step.name] = {
            k: hashlib.sha256(v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in state.items()
        }
    return out


def differences(before: Path, after: Path) -> list[str]:
    """What differs between two run folders of one preset (empty: nothing)."""
    out = []
    lb, la = losses(before), losses(after)
    if lb != la or not lb:
        out.append(f"losses differ or none logged ({len(lb)} / {len(la)} rows)")
    for name in PLAN_FILES:
        if [f.read_bytes() for f in sorted(before.rglob(name))] != [
            f.read_bytes() for f in sorted(after.rglob(name))
        ]:
            out.append(f"{name} differs")
    cb, ca = checkpoints(before), checkpoints(after)
    if cb != ca:
        keys = sorted({f"{s}/{k}" for s in cb | ca for k in cb.get(s, {}) | ca.get(s, {})
                       if cb.get(s, {}).get(k) != ca.get(s, {}).get(k)})  # fmt: skip
        out.append(f"checkpoint tensors differ: {', '.join(keys[:3])}")
    return out


def main(argv: list[str]) -> int:
    before, after = Path(argv[0]), Path(argv[1])
    bad = 0
    for run in sorted(p for p in before.iterdir() if p.is_dir()):
        other = after / run.name
        found = differences(run, other) if other.is_dir() else ["missing in " + str(after)]
        print(f"{run.name}: {'; '.join(found) or 'equal'}")
        bad += bool(found)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
