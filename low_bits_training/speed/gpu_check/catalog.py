"""The GPU check's levels and items as data: each item's time budget, whether it needs CUDA, what each level
needs installed, and what a wheelhouse would install. Standard library only: the dry run and the entry point
read this on any torch, torchtitan and torchao absent.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

BUDGET_S = 480
"""Default ``--budget-s``: 8 minutes on one H100, from a cold start (no compiled kernels cached)."""
WHEELS_FILE = Path(__file__).with_name("wheels.txt")
"""The wheels a node without network needs beyond torch (``scripts/build_wheelhouse.sh`` reads it too)."""
PINNED = ("torchao", "torchtitan")
"""Installed from a wheelhouse even over another version on the node: the stack is pinned (README)."""
RECIPES = ("bf16", "fp8_tensorwise", "fp8_rowwise", "mxfp8", "nvfp4", "deepseek_fp8")
"""The recipes of the summary table (backends, step-time ratios, bit-exactness)."""


@dataclass(frozen=True)
class Item:
    """One check: its name, the seconds it may take (skipped when less is left), where its code lives."""

    name: str
    budget_s: int
    func: str
    """``module:function`` in this package; the function takes a ``runner.Context`` and returns rows."""
    needs_cuda: bool = True
    """False: it runs on the CPU build too (the same code path, CPU tensors)."""


@dataclass(frozen=True)
class Level:
    """A level: what it needs installed (distribution names) and its items, run in order."""

    number: int
    name: str
    needs: tuple[str, ...]
    items: tuple[Item, ...]

    @property
    def budget_s(self) -> int:
        return sum(i.budget_s for i in self.items)


LEVELS = (
    Level(0, "GPU-marked tests", ("pytest",), (Item("tests marked @pytest.mark.gpu", 30, "processes:gpu_tests"),)),
    Level(1, "torch only", (), (
        Item("backends per recipe", 5, "device:backend_rows", needs_cuda=False),
        Item("import survey", 30, "processes:import_survey", needs_cuda=False),
        Item("_scaled_mm bit-exact", 10, "parity:scaled_mm_exact_rows", needs_cuda=False),
        Item("_scaled_mm vs emulation", 10, "parity:real_vs_emulation_rows", needs_cuda=False),
        Item("fp32-accumulate GEMM vs float64", 10, "device:accumulate_rows", needs_cuda=False),
        Item("casts cuda == cpu", 15, "parity:cast_rows"),
        Item("QuantLinear cuda == cpu", 20, "parity:recipe_rows"),
        Item("CUDA graph replay == eager", 30, "graphs:graph_rows"),
        Item("block step time vs bf16", 195, "block:block_rows"),
    )),
    Level(2, "torchao", ("torchao",), (
        Item("torchao vs emulation", 25, "parity:torchao_rows"),
        Item("NaN guard", 10, "processes:guard_rows", needs_cuda=False),
    )),
    Level(3, "torchtitan", ("torchao", "torchtitan", "datasets"), (
        Item("train mxfp8 emulated, compiled, CUDA graphs on", 90, "processes:train_rows"),
    )),
)  # fmt: skip
"""Every level, in the order they run; the budgets sum to ``BUDGET_S``."""


def level(number: int) -> Level:
    """The level numbered ``number``."""
    return next(lv for lv in LEVELS if lv.number == number)


def version(dist: str) -> str | None:
    """The installed version of distribution ``dist`` (None: not installed)."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def missing(lv: Level) -> list[str]:
    """What ``lv`` needs that this Python lacks."""
    return [d for d in lv.needs if version(d) is None]


def wanted_wheels(path: Path = WHEELS_FILE) -> list[tuple[str, str]]:
    """(distribution, version) of every wheel in the list, in its order."""
    out = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, ver = line.partition("==")
            out.append((name, ver))
    return out


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheelhouse_plan(folder: Path) -> list[dict]:
    """What ``--wheelhouse folder`` installs: one entry per wheel file, with the action and why.

    A wheel is installed when its distribution is missing here, or (``PINNED``) installed at another
    version; else the node's copy is kept (never torch's: no wheel of torch is in the list).

    Returns:
        ``{"wheel", "dist", "version", "installed", "action": "install" | "keep"}`` per wheel, sorted.
    """
    out = []
    for whl in sorted(folder.glob("*.whl")):
        dist, ver = whl.name.split("-")[:2]
        have = version(dist)
        pinned = _canonical(dist) in PINNED and have not in (None, ver)
        action = "install" if have is None or pinned else "keep"
        out.append({"wheel": whl.name, "dist": dist, "version": ver, "installed": have, "action": action})
    return out


def dry_run_lines(cuda: bool, wheelhouse: Path | None, budget_s: int) -> list[str]:
    """The ``--dry-run`` listing: every level, its budget, what it needs, its items and their budgets."""
    total = sum(lv.budget_s for lv in LEVELS)
    lines = [f"budget: {budget_s} s (--budget-s); the items below sum to {total} s; an item is skipped when "
             "less than its budget is left", f"python {sys.version.split()[0]}; CUDA: {cuda}"]  # fmt: skip
    for lv in LEVELS:
        need = ", ".join(lv.needs) or "torch"
        gone = missing(lv)
        state = f"missing here: {', '.join(gone)}" if gone else "installed"
        lines.append(f"level {lv.number} ({lv.name}): {lv.budget_s} s; needs {need} ({state})")
        lines += [f"  - {i.name}: {i.budget_s} s{'' if i.needs_cuda else ', runs on the CPU build too'}"
                  for i in lv.items]  # fmt: skip
    lines += [NO_TORCHTITAN, *wheelhouse_lines(wheelhouse)]
    return lines


NO_TORCHTITAN = (
    "without torchtitan (it needs torch >= 2.14.1; on torch 2.11 it does not import): levels 0-2 run and "
    "level 3 is skipped with that reason; torchao 0.18 on an older torch: the import is tried and the "
    "result reported (its compiled kernels are built for torch 2.14.1)"
)


def wheelhouse_lines(folder: Path | None) -> list[str]:
    """What ``--wheelhouse folder`` would install, one line per wheel (nothing without a folder)."""
    if folder is None:
        return ["no --wheelhouse: levels 2-3 use what this Python has installed"]
    if not folder.is_dir():
        return [f"--wheelhouse {folder}: not a folder"]
    plan = wheelhouse_plan(folder)
    head = (f"--wheelhouse {folder}: pip install --no-index --find-links {folder} --no-deps --target <temporary "
            f"folder on PYTHONPATH>; {sum(p['action'] == 'install' for p in plan)} of {len(plan)} wheels")  # fmt: skip
    body = [f"  {p['action']} {p['dist']} {p['version']}"
            + (f" (this Python has {p['installed']})" if p["installed"] else "") for p in plan]  # fmt: skip
    return [head, *body]
