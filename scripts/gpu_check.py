"""The GPU check in one command (``scripts/gpu_check.sh``): what runs on this GPU, level by level.

    scripts/gpu_check.sh                     # every level this machine can run
    scripts/gpu_check.sh --dry-run           # list what it would run (no GPU needed); exit 0
    scripts/gpu_check.sh --levels 1,2 --out outputs/gpu_check/h100

Level 0: the tests marked ``@pytest.mark.gpu`` (issue 29's items), run first. Level 1 (torch only): the
package imports (each module; which fails on this torch, and why), every format's cast and every recipe's
QuantLinear on CUDA against the CPU, ``torch._scaled_mm`` against the emulation, linear speed per recipe
next to the speed model's prediction. Level 2 (torchao): torchao's modules against the emulation, and their
speed. Level 3 (torchtitan): the debug model trains a few compiled steps with fp8_rowwise.
Writes ``gpu_check.md`` (the table) and ``gpu_check.json`` to ``--out``. Exit code 1 when an item fails.
Only the standard library and torch are imported up front, so it starts on any torch (2.11 included).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout, installed or not
LEVELS = {0: "GPU-marked tests", 1: "torch only", 2: "torchao", 3: "torchtitan"}
GPU_MARK = re.compile(r"pytest\.mark\.gpu\b")
TRAIN = [
    "--training.steps",
    "6",
    "--compile.enable",
    "--quantize.recipe",
    "fp8_rowwise",
    "--checkpoint.no-enable",
]
SURVEY = """import importlib, json, pkgutil, sys
import low_bits_training as p
out = {}
for m in pkgutil.walk_packages(p.__path__, "low_bits_training."):
    try:
        importlib.import_module(m.name)
    except BaseException as e:
        out[m.name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:200]
print(json.dumps(out))
"""


def version(pkg: str) -> str | None:
    """The installed version of ``pkg`` (None: not installed)."""
    from importlib import metadata

    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """torch, CUDA, the device and which optional packages are installed."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": cuda,
        "device": torch.cuda.get_device_name(0) if cuda else None,
        "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "torchao": version("torchao"),
        "torchtitan": version("torchtitan"),
        "pytest": version("pytest"),
    }


def gpu_tests() -> list[str]:
    """Test files under tests/ that mark tests for a GPU (``pytest.mark.gpu``)."""
    files = sorted((REPO / "tests").rglob("test_*.py"))
    return [str(f.relative_to(REPO)) for f in files if GPU_MARK.search(f.read_text())]


def availability(level: int, env: dict) -> tuple[bool, str]:
    """Whether ``level`` can run here, and every reason it cannot."""
    why = [] if env["cuda"] else ["no CUDA device visible"]
    need = {0: ["pytest"], 1: [], 2: ["torchao"], 3: ["torchao", "torchtitan"]}[level]
    missing = [p for p in need if env[p] is None]
    if missing:
        why.append(f"{' and '.join(missing)} not installed (docs/speed_model.md: carrying wheels)")
    if level == 0 and not gpu_tests():
        why.append("no test is marked @pytest.mark.gpu yet (issue 29 adds them)")
    return not why, "; ".join(why)


def items(level: int) -> list[str]:
    """What ``level`` runs, by name (the package's own checks; an import failure is an item of its own)."""
    if level == 0:
        return gpu_tests()
    if level == 3:
        return ["train debug model: 6 compiled steps, fp8_rowwise (" + " ".join(TRAIN) + ")"]
    try:
        from low_bits_training.speed import gpu_checks
    except Exception as e:  # an older torch: the import survey says which module and why
        return [f"cannot list: low_bits_training.speed.gpu_checks does not import ({type(e).__name__}: {e})"]
    return ["import survey"] + gpu_checks.level1_items() if level == 1 else gpu_checks.level2_items()


def import_survey() -> dict:
    """One result row per package module that fails to import on this torch (a fresh interpreter)."""
    p = subprocess.run([sys.executable, "-c", SURVEY], cwd=REPO, capture_output=True, text=True, timeout=600)
    if p.returncode != 0 or not p.stdout.strip():
        return {"level": 1, "item": "import survey", "status": "fail", "detail": p.stderr.strip()[-300:]}
    failed = json.loads(p.stdout.strip().splitlines()[-1])
    detail = "; ".join(f"{m}: {why}" for m, why in failed.items()) or "every module imports"
    status = "fail" if any(m.split(".")[1] in ("formats", "nn") for m in failed) else "ok"
    return {"level": 1, "item": "import survey", "status": status, "detail": detail, "failed": failed}


def run_item(level: int, name: str) -> dict:
    """Run one level-1 / level-2 item by name; an exception is a failed row, not a crash."""
    if name.startswith("cannot list"):
        return {"level": level, "item": "package import", "status": "fail", "detail": name}
    try:
        from low_bits_training.speed import gpu_checks as g

        if name.startswith("cast "):
            return g.cast_parity(*name.split()[1:3])
        if name.startswith("QuantLinear"):
            return g.recipe_parity(name.rsplit(" ", 1)[1])
        if name.startswith("_scaled_mm"):
            return g.real_vs_emulation(name.rsplit(" ", 1)[1])
        if name.startswith("speed "):
            _, recipe, shape = name.split()
            return g.linear_speed(recipe, tuple(int(v) for v in shape.split("x")))
        if name.startswith("torchao vs"):
            return g.torchao_vs_emulation(name.rsplit(" ", 1)[1])
        return g.linear_speed(name.rsplit(" ", 1)[1], g.SPEED_SHAPES[-1], level=2, torchao=True)
    except Exception as e:
        return {"level": level, "item": name, "status": "fail", "detail": f"{type(e).__name__}: {e}"[:300]}


def run_gpu_tests(out: Path) -> list[dict]:
    """Level 0: pytest on the GPU-marked tests; one row per test (JUnit XML)."""
    import xml.etree.ElementTree as ET

    xml = out / "level0.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", f"--junitxml={xml}", *gpu_tests()]
    subprocess.run(cmd, cwd=REPO, timeout=3600)
    rows = []
    for case in ET.parse(xml).getroot().iter("testcase"):
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        status = "fail" if bad is not None else ("skip" if case.find("skipped") is not None else "ok")
        detail = (bad.get("message") or "")[:200] if bad is not None else ""
        rows.append(
            {
                "level": 0,
                "item": f"{case.get('classname')}::{case.get('name')}",
                "status": status,
                "detail": detail,
            }
        )
    return rows  # fmt: skip


def run_training(out: Path) -> dict:
    """Level 3: the debug model, a few compiled steps with fp8_rowwise, through the launcher."""
    folder = out / "train_fp8_rowwise"
    cmd = [sys.executable, "-m", "low_bits_training.titan.launch.launcher", "--nproc_per_node=1", "--rdzv_backend",
           "c10d", "--rdzv_endpoint=localhost:0", "--", "--config-file", "train_configs/debug_model.toml",
           "--dump_folder", str(folder), *TRAIN]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    losses = [json.loads(ln).get("loss_metrics/global_avg_loss") for ln in _metrics(folder)]
    losses = [v for v in losses if v is not None]
    ok = p.returncode == 0 and len(losses) > 1 and all(v == v for v in losses) and losses[-1] < losses[0]
    detail = f"exit {p.returncode}; losses {[round(v, 3) for v in losses]}" + (
        "" if ok else f"; {p.stderr[-300:]}"
    )
    return {
        "level": 3,
        "item": items(3)[0],
        "status": "ok" if ok else "fail",
        "detail": detail,
        "losses": losses,
    }


def _metrics(folder: Path) -> list[str]:
    files = list(folder.rglob("metrics.jsonl"))
    return files[0].read_text().splitlines() if files else []


def run_level(level: int, out: Path) -> list[dict]:
    if level == 0:
        return run_gpu_tests(out)
    if level == 3:
        return [run_training(out)]
    names = items(level)
    rows = [import_survey()] if level == 1 else []
    return rows + [run_item(level, n) for n in names if n != "import survey"]


def listing(env: dict, levels: list[int]) -> list[dict]:
    """Per level: its name, whether it can run here (and why not), and its items."""
    out = []
    for level in levels:
        ok, why = availability(level, env)
        out.append(
            {"level": level, "name": LEVELS[level], "available": ok, "why": why, "items": items(level)}
        )
    return out


def markdown(env: dict, plan: list[dict], rows: list[dict]) -> str:
    """The report: the machine, which levels ran (or why not), one table row per item."""
    head = [f"GPU check: {env['device'] or 'no CUDA device'}, torch {env['torch']}, torchao {env['torchao']}, "
            f"torchtitan {env['torchtitan']}"]  # fmt: skip
    head += [
        f"- level {p['level']} ({p['name']}): " + ("ran" if p["available"] else f"skipped: {p['why']}")
        for p in plan
    ]
    table = ["| level | item | status | detail |", "|---|---|---|---|"]
    table += [f"| {r['level']} | {r['item']} | {r['status']} | {r['detail']} |" for r in rows]
    return "\n".join(head + [""] + table) + "\n"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="list what would run (no GPU needed) and exit 0")
    p.add_argument("--levels", default="0,1,2,3", help="comma-separated levels to run (default: all)")
    p.add_argument("--out", default=str(REPO / "outputs" / "gpu_check"), help="folder for the table and JSON")
    ns = p.parse_args(argv)
    raw = ns.levels
    try:
        ns.levels = sorted({int(v) for v in raw.split(",")})
    except ValueError:
        ns.levels = [-1]
    if not set(ns.levels) <= set(LEVELS):
        p.exit(
            2, f"gpu_check: config error: --levels = {raw!r}: expected a comma-separated subset of 0,1,2,3\n"
        )
    return ns


def main(argv: list[str] | None = None) -> int:
    ns = parse_args(sys.argv[1:] if argv is None else argv)
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    plan = listing(env, ns.levels)
    rows: list[dict] = []
    if not ns.dry_run:
        for level in (p["level"] for p in plan if p["available"]):
            start = time.time()
            rows += run_level(level, out)
            print(f"level {level} ({LEVELS[level]}): {time.time() - start:.0f} s", flush=True)
    report = {"dry_run": ns.dry_run, "environment": env, "levels": plan, "results": rows}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(env, plan, rows)
    (out / "gpu_check.md").write_text(text)
    print(text if not ns.dry_run else _dry_text(plan))
    print(f"written: {out / 'gpu_check.md'}, {out / 'gpu_check.json'}")
    return 1 if any(r["status"] == "fail" for r in rows) else 0


def _dry_text(plan: list[dict]) -> str:
    lines = []
    for p in plan:
        state = "would run" if p["available"] else f"cannot run here ({p['why']})"
        lines += [f"level {p['level']} ({p['name']}): {state}; {len(p['items'])} items"]
        lines += [f"  - {i}" for i in p["items"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
