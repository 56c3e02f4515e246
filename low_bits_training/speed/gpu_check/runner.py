"""The GPU check as one command (after ``scripts/gpu_check.py``'s refusal of a driver without CUDA, which
needs titan/ and so lives in the entry point): levels in order, each item skipped when less than its budget is left,
the time of each level printed, the table and the JSON written, the exit code (0 ok, 1 a check failed,
2 a driver without CUDA or a bad flag). Standard library and torch at import; each item's module is
imported when the item runs, so an old torch reports what does not import instead of stopping.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import catalog, report

REPO = Path(__file__).resolve().parents[3]


@dataclass
class Context:
    """What every item is given: the device it runs on, the output folder, and when the budget runs out."""

    device: str
    out: Path
    deadline: float
    """``time.monotonic()`` at which the budget is spent (long items stop early and say so)."""
    items: tuple[str, ...] = ()
    """``--items``: run only items whose name contains one of these (empty: every item)."""
    env: dict = field(default_factory=dict)

    def left(self) -> float:
        """Seconds of budget left."""
        return self.deadline - time.monotonic()


def environment() -> dict:
    """torch, CUDA, the device, and the versions of the optional packages."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": cuda,
        "device": torch.cuda.get_device_name(0) if cuda else None,
        "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        **{d: catalog.version(d) for d in ("torchao", "torchtitan", "datasets", "pytest")},
    }


def run_item(item: catalog.Item, ctx: Context) -> list[dict]:
    """One item's rows (budget and CUDA permitting); an exception is a failed row, not a crash."""
    base = {"item": item.name, "budget_s": item.budget_s}
    if item.needs_cuda and ctx.device != "cuda":
        return [{**base, "status": "skip", "detail": "skip: no CUDA device visible"}]
    if ctx.left() < item.budget_s:
        why = f"skip: needs ~{item.budget_s} s, {max(ctx.left(), 0):.0f} s of --budget-s left"
        return [{**base, "status": "skip", "detail": why}]
    start = time.monotonic()
    module, func = item.func.split(":")
    try:
        rows = getattr(importlib.import_module(f"{__package__}.{module}"), func)(ctx)
    except Exception as e:  # a check's failure is its result: one row, exit 1 at the end
        rows = [
            {
                "status": "fail",
                "detail": f"{type(e).__name__}: {str(e).splitlines()[0][:240] if str(e) else ''}",
            }
        ]
    took = time.monotonic() - start
    return [{**base, "seconds": round(took, 2), **r} for r in rows]


IMPORTS = {2: "import torchao", 3: "import torchtitan.train, datasets"}
"""What a level imports, tried in a child first: installed is not importable (torchtitan 0.3.0 calls torch
>= 2.14.1 APIs; torchao 0.18's kernels are built for torch 2.14.1)."""


def level_refusal(lv: catalog.Level, ctx: Context) -> str | None:
    """Why ``lv`` cannot run here (a package missing, or its import failing), None: it can."""
    gone = catalog.missing(lv)
    if gone:
        return f"{', '.join(gone)} not installed (--wheelhouse DIR: docs/speed_model.md)"
    runs_here = any(ctx.device == "cuda" or not i.needs_cuda for i in lv.items)
    return import_failure(IMPORTS[lv.number]) if lv.number in IMPORTS and runs_here else None


def import_failure(code: str) -> str | None:
    """The last line of ``python -c code``'s error on this torch (None: it ran)."""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if p.returncode == 0:
        return None
    last = (p.stderr.strip().splitlines() or ["?"])[-1][:200]
    return f"`{code}` fails on torch {environment()['torch']}: {last}"


def run_level(lv: catalog.Level, ctx: Context) -> list[dict]:
    """Every selected item of ``lv``, or one skip row naming what the level lacks."""
    if why := level_refusal(lv, ctx):
        return [
            {"item": f"level {lv.number}", "status": "skip", "detail": f"skip: {why}", "level": lv.number}
        ]
    chosen = [i for i in lv.items if not ctx.items or any(s in i.name for s in ctx.items)]
    return [{"level": lv.number, **r} for i in chosen for r in run_item(i, ctx)]


def install_wheelhouse(folder: Path) -> Path:
    """Install the wheels of ``folder`` this Python lacks into a temporary folder, put it on ``sys.path``
    and ``PYTHONPATH`` (the node's own packages, torch first of all, are never touched).

    Returns:
        The temporary folder.

    Raises:
        RuntimeError: pip failed (its last line).
    """
    target = Path(tempfile.mkdtemp(prefix="gpu-check-site-"))
    wheels = [str(folder / p["wheel"]) for p in catalog.wheelhouse_plan(folder) if p["action"] == "install"]
    if wheels:
        cmd = [sys.executable, "-m", "pip", "install", "--no-index", "--find-links", str(folder), "--no-deps",
               "--target", str(target), *wheels]  # fmt: skip
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(
                f"pip install from {folder} failed: {(p.stderr.strip().splitlines() or ['?'])[-1]}"
            )
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    importlib.invalidate_caches()
    return target


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The flags; a bad ``--levels`` is one line and exit code 2."""
    p = argparse.ArgumentParser(prog="gpu_check.sh", description="The GPU check in one command.")
    p.add_argument("--dry-run", action="store_true", help="list levels, budgets and installs; exit 0")
    p.add_argument("--levels", default="0,1,2,3", help="comma-separated levels to run (default: all)")
    p.add_argument("--budget-s", type=int, default=catalog.BUDGET_S, help="seconds for everything (480)")
    p.add_argument("--items", default="", help="comma-separated substrings: run only the items they name")
    p.add_argument("--wheelhouse", default=None, help="install missing wheels from this folder first")
    p.add_argument("--out", default=str(REPO / "outputs" / "gpu_check"), help="folder for the table and JSON")
    ns = p.parse_args(argv)
    raw = ns.levels
    try:
        ns.levels = sorted({int(v) for v in raw.split(",")})
    except ValueError:
        ns.levels = [-1]
    if not set(ns.levels) <= {lv.number for lv in catalog.LEVELS}:
        p.exit(
            2, f"gpu_check: config error: --levels = {raw!r}: expected a comma-separated subset of 0,1,2,3\n"
        )
    ns.items = tuple(s for s in ns.items.split(",") if s)
    return ns


def main(argv: list[str] | None = None) -> int:
    """Run the check (see the module doc); returns the exit code."""
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    wheelhouse, env = Path(ns.wheelhouse) if ns.wheelhouse else None, environment()
    if ns.dry_run:  # a listing: runs anywhere
        print("\n".join(catalog.dry_run_lines(env["cuda"], wheelhouse, ns.budget_s)))
        if env["torchao"]:  # torchao 0.18 on an older torch may not import: say which
            print(f"torchao {env['torchao']} here: {import_failure(IMPORTS[2]) or 'imports'}")
        return 0
    if wheelhouse is not None:
        print(f"wheelhouse: installed into {install_wheelhouse(wheelhouse)}", flush=True)
        env = environment()
    print(f"TORCHINDUCTOR_CACHE_DIR={os.environ.get('TORCHINDUCTOR_CACHE_DIR')}", flush=True)
    return run(ns, env)


def run(ns: argparse.Namespace, env: dict) -> int:
    """The levels of ``ns`` within its budget; writes the report; returns the exit code."""
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context("cuda" if env["cuda"] else "cpu", out, time.monotonic() + ns.budget_s, ns.items, env)
    rows, times = [], {}
    for lv in (catalog.level(n) for n in ns.levels):
        start = time.monotonic()
        rows += run_level(lv, ctx)
        times[lv.number] = round(time.monotonic() - start, 1)
        print(f"level {lv.number} ({lv.name}): {times[lv.number]:.1f} s (budget {lv.budget_s} s)", flush=True)
    text = report.write(out, env, ns.budget_s, times, rows)
    print(text)
    print(f"written: {out / 'gpu_check.md'}, {out / 'gpu_check.json'}")
    return 1 if any(r["status"] == "fail" for r in rows) else 0


def load_json(out: Path) -> dict:
    """The JSON report a run wrote to ``out``."""
    return json.loads((out / "gpu_check.json").read_text())
