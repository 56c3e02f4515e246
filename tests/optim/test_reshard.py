"""DCP resharding of quantized optimizer states: save on N CPU ranks (FSDP2), load on M, states identical."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("reshard_worker.py")


def _torchrun(nproc: int, *args: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        "--rdzv_backend=c10d",
        "--rdzv_endpoint=localhost:0",
        str(WORKER),
        *args,
    ]
    p = subprocess.run(
        cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p.stdout


def test_quantized_states_reshard_exactly_2_to_1_and_1_to_2(tmp_path):
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    _torchrun(2, "save", str(tmp_path / "a"))  # FSDP2 over 2 ranks, uneven row shards (301 rows)
    assert "RESHARD-OK" in _torchrun(1, "load", str(tmp_path / "a"), str(tmp_path / "b"))  # 2 -> 1, re-save
    assert "RESHARD-OK" in _torchrun(2, "load", str(tmp_path / "b"))  # 1 -> 2
