"""The items that run in a child process: the GPU-marked tests (level 0), the import survey (level 1), the NaN
guard (level 2) and a short torchtitan training (level 3: an emulated recipe, compiled, with CUDA graphs on;
its peak memory against the launcher's plan).
What they check lives in titan/, which speed/ may not import (tests/test_layering.py): a child runs it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from low_bits_training.run.folder import PEAK_JSON

from .parity import row

REPO = Path(__file__).resolve().parents[3]
GPU_MARK = re.compile(r"pytest\.mark\.gpu\b")
TRAIN = ("--training.steps", "6", "--compile.enable", "--quantize.recipe", "mxfp8", "--quantize.backend", "emulate",
         "--checkpoint.no-enable", "--metrics.log_freq", "1")  # fmt: skip
"""Level 3's flags: our MXFP8 emulation (not torchao's kernel) under torchtitan's compile and CUDA graphs."""
GRAPHS_OFF = "CUDA graphs off"
"""How the worker's line starts when something turned CUDA graphs off: ``titan.runtime.graphs.GRAPHS_OFF``
(speed/ may not import titan/; tests/speed/test_gpu_check.py holds the two equal)."""
GUARD = """from low_bits_training.titan.platform import compat
compat.guard_fp8_stores()
print(compat.fp8_stores_guarded())
"""
SURVEY = """import importlib, json, pkgutil
import low_bits_training as p
out = {}
for m in pkgutil.walk_packages(p.__path__, "low_bits_training."):
    try:
        importlib.import_module(m.name)
    except BaseException as e:
        out[m.name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
print(json.dumps(out))
"""


def gpu_test_files() -> list[str]:
    """Test files under tests/ that mark tests for a GPU (``pytest.mark.gpu``)."""
    files = sorted((REPO / "tests").rglob("test_*.py"))
    return [str(f.relative_to(REPO)) for f in files if GPU_MARK.search(f.read_text())]


def gpu_tests(ctx) -> list[dict]:
    """Level 0: pytest on the GPU-marked tests, one row per test (JUnit XML)."""
    import xml.etree.ElementTree as ET

    files = gpu_test_files()
    if not files:
        return [row("skip", "skip: no test is marked @pytest.mark.gpu")]
    xml = ctx.out / "level0.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", f"--junitxml={xml}", *files]
    subprocess.run(cmd, cwd=REPO, timeout=max(ctx.left(), 1))
    out = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        status = "fail" if bad is not None else ("skip" if case.find("skipped") is not None else "ok")
        detail = (bad.get("message") or "")[:200] if bad is not None else ""
        out.append(row(status, detail, case=f"{case.get('classname')}::{case.get('name')}"))
    return out


def import_survey(ctx) -> list[dict]:
    """Every package module imported in a fresh interpreter: which fail on this torch, and why (a failure in
    formats/ or nn/ fails the row; titan/, cli/ and report/ may lack torchtitan or plotting packages)."""
    p = subprocess.run([sys.executable, "-c", SURVEY], cwd=REPO, capture_output=True, text=True,
                       timeout=max(ctx.left(), 1))  # fmt: skip
    if p.returncode != 0 or not p.stdout.strip():
        return [row("fail", p.stderr.strip()[-300:])]
    failed = json.loads(p.stdout.strip().splitlines()[-1])
    detail = "; ".join(f"{m}: {why}" for m, why in failed.items()) or "every module imports"
    status = "fail" if any(m.split(".")[1] in ("formats", "nn") for m in failed) else "ok"
    return [row(status, detail, failed=failed)]


def guard_rows(ctx) -> list[dict]:
    """The NaN guard of fp8 stores: torchao's inductor min/max patch active after
    ``titan.platform.compat.guard_fp8_stores`` (inductor's Triton min/max emit ``tl.where``)."""
    p = subprocess.run([sys.executable, "-c", GUARD], cwd=REPO, capture_output=True, text=True,
                       timeout=max(ctx.left(), 1))  # fmt: skip
    on = p.returncode == 0 and p.stdout.strip().splitlines()[-1:] == ["True"]
    detail = "inductor's Triton min/max emit tl.where" if on else f"not applied: {p.stderr.strip()[-200:]}"
    return [row("ok" if on else "fail", detail)]


def _losses(folder: Path) -> list[float]:
    files = list(folder.rglob("metrics.jsonl"))
    lines = files[0].read_text().splitlines() if files else []
    values = [json.loads(ln).get("loss_metrics/global_avg_loss") for ln in lines]
    return [v for v in values if v is not None]


def train_rows(ctx) -> list[dict]:
    """Level 3: the debug model trains 6 steps through the launcher with our MXFP8 emulation, compiled;
    nothing may turn CUDA graphs off (``titan.runtime.graphs.graph_blockers``) and the loss must fall."""
    folder = ctx.out / "train_mxfp8_emulated"
    cmd = [sys.executable, "-m", "low_bits_training.titan.launch.launcher", "--nproc_per_node=1", "--rdzv_backend",
           "c10d", "--rdzv_endpoint=localhost:0", "--", "--config-file", "train_configs/debug_model.toml",
           "--dump_folder", str(folder), *TRAIN]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=max(ctx.left(), 1))
    losses, log = _losses(folder), p.stdout + p.stderr
    graphs_off = next((ln.strip() for ln in log.splitlines() if GRAPHS_OFF in ln), None)
    falls = len(losses) > 1 and all(v == v for v in losses) and losses[-1] < losses[0]
    ok = p.returncode == 0 and falls and graphs_off is None
    detail = f"exit {p.returncode}; losses {[round(v, 3) for v in losses]}; " + (
        graphs_off or "CUDA graphs on"
    )
    detail += "" if ok else f"; {p.stderr.strip()[-300:]}"
    peak = folder / PEAK_JSON
    plan = peak_row(json.loads(peak.read_text()) if peak.is_file() else None)
    return [row("ok" if ok else "fail", detail, losses=losses, command=" ".join(TRAIN)), plan]


def peak_row(peak: dict | None) -> dict:
    """The run's peak (``torch.cuda.max_memory_allocated`` on a GPU) against the launcher's plan of a later step
    (``peak_memory.json``; docs/memory.md): ok within 10% either way, else fail (a plan below the measured peak
    passes runs that may OOM; one far above refuses runs that would fit)."""
    if peak is None or not peak.get("planned"):
        return row(
            "info", "no peak_memory.json with a plan: the launcher did not plan this run", case="peak memory"
        )
    planned, measured = peak["planned"]["later_steps"], peak["measured"]["peak"]
    ratio = measured / planned
    detail = f"planned {planned / 2**20:.1f} MiB, measured {measured / 2**20:.1f} MiB ({ratio - 1:+.1%})"
    status = "ok" if abs(ratio - 1) <= 0.10 else "fail"
    return row(status, detail, case="peak memory", planned=planned, measured=measured)
