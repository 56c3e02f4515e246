"""No package code reaches a private torch / torchtitan / torchao name except through
``titan/platform/compat.py``.

``private_names`` reads every module with ``ast``: imports of a private module or name from the three
upstreams, attribute accesses ``x._name`` (and ``getattr(x, "_name")``) whose name the package never
defines itself. Allowed outside compat: the CPU adapters (``titan/platform/cpu.py``, patches by design), the
names torch documents for use although they start with an underscore (``SEMI_PUBLIC``), and
``low_bits_training/upstream.py``, compat's half for the floors below titan (which may not import compat): its
records are in ``compat.UPSTREAM``, digest-checked like the shims. Nothing else, in any layer.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import REPO
from low_bits_training import upstream
from low_bits_training.titan.platform import compat

UPSTREAMS = ("torch", "torchtitan", "torchao")
SEMI_PUBLIC = {
    "_dynamo": "torch._dynamo.config: the documented home of dynamo's settings",
    "_inductor": "torch._inductor.config: the documented home of inductor's settings",
    "_scaled_mm": "torch._scaled_mm: the fp8 GEMM torch's own fp8 recipes call",
    "_scaled_dot_product_flash_attention_for_cpu": "an aten op name (profiling's FLOP table)",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "an aten op name (profiling's FLOP table)",
}
EXEMPT = ("titan/platform/compat.py", "titan/platform/cpu.py", "upstream.py")


def _defined(trees) -> set[str]:
    out = set()
    for tree in trees:
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                out.add(n.id)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                out.add(n.attr)
            elif isinstance(n, ast.arg):
                out.add(n.arg)
            elif isinstance(n, ast.alias):
                out.add(n.asname or n.name.split(".")[0])
            elif isinstance(n, ast.keyword) and n.arg:
                out.add(n.arg)
    return out


def _private(node, ours: set[str]) -> list[str]:
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in UPSTREAMS:
        parts = [p for p in node.module.split(".") if p.startswith("_")]
        return parts + [a.name for a in node.names if a.name.startswith("_")]
    if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
        return [] if node.attr in ours else [node.attr]
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr", "setattr"):
        name = node.args[1] if len(node.args) > 1 else None
        if isinstance(name, ast.Constant) and isinstance(name.value, str) and name.value.startswith("_"):
            return [] if name.value.startswith("__") or name.value in ours else [name.value]
    return []


def private_names(package: Path) -> list[tuple[str, int, str]]:
    """``(path, line, name)`` of every private upstream name the package reaches outside what is allowed."""
    files = {p: ast.parse(p.read_text()) for p in sorted(package.rglob("*.py"))}
    ours = _defined(files.values())
    out = []
    for path, tree in files.items():
        rel = path.relative_to(package).as_posix()
        if rel in EXEMPT:
            continue
        for node in ast.walk(tree):
            for name in _private(node, ours):
                if name in SEMI_PUBLIC:
                    continue
                out.append((rel, node.lineno, name))
    return out


def test_no_private_upstream_name_outside_compat():
    found = private_names(REPO / "low_bits_training")
    assert not found, "\n".join(f"{p}:{line}: {name}" for p, line, name in found)


def test_the_check_fails_on_a_private_access(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "titan").mkdir(parents=True)
    (pkg / "titan" / "a.py").write_text(
        "import torch\n"
        "from torchtitan.models.llama3 import _build_llama3_layers\n"
        "def f(m):\n"
        "    m._mine = 1\n"
        "    return m._mine, m._sharded_param_data, getattr(m, '_owner'), torch._dynamo\n"
    )
    got = sorted(name for _, _, name in private_names(pkg))
    assert got == ["_build_llama3_layers", "_owner", "_sharded_param_data"]


def test_every_private_name_of_the_floors_below_titan_is_recorded_in_compat():
    """``upstream.py`` may reach private names only with a record, and compat's ``UPSTREAM`` holds each record
    (so test_compat digest-checks them)."""
    path = REPO / "low_bits_training" / "upstream.py"
    tree = ast.parse(path.read_text())
    reached = {name for node in ast.walk(tree) for name in _private(node, set())} - set(SEMI_PUBLIC)
    recorded = {part for u in upstream.RECORDS.values() for part in u.target.replace(":", ".").split(".")}
    assert reached, "the check reads nothing: upstream.py reaches no private name?"
    assert reached <= recorded, f"private names in upstream.py without a record: {sorted(reached - recorded)}"
    assert all(compat.UPSTREAM[k] is u for k, u in upstream.RECORDS.items())
