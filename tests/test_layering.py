"""The package's layering, pinned: every import of the package's own modules (module level and inside functions)
goes along the arrow, and no import circle exists between modules, not even inside one folder.

The arrow (README, "Layers"):

    formats <- numerics <- nn <- {optim, config} <- {run, plan} <- {titan, speed} <- report <- cli
    data/, errors (the one ConfigError), source (the source digest) and upstream (the private torch names below
    titan) beside formats; run/ (run folder, exit codes, secrets) needs only config

Each layer may import the layers listed for it in ``MAY_IMPORT`` (and its own modules); nothing else. Inside
titan the rooms go by lifecycle, ``platform <- plan <- runtime <- launch`` (``TITAN_ROOMS``). The
checker is held to a small made-up package too: an arrow against the table or a circle fails it.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "low_bits_training"

_BASE = {"formats", "data", "errors", "upstream", "source"}
MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(),
    "source": set(),
    "upstream": set(),
    "formats": {"upstream"},
    "data": set(),
    "numerics": {"formats"},
    "nn": {"errors", "upstream", "formats", "numerics"},
    "optim": {*_BASE, "numerics", "nn"},
    "config": {*_BASE, "numerics", "nn"},
    "run": {*_BASE, "config"},
    "plan": {*_BASE, "numerics", "nn", "config"},
    "titan": {*_BASE, "numerics", "nn", "optim", "config", "run", "plan"},
    "speed": {*_BASE, "numerics", "nn", "optim", "config", "run", "plan"},
    "report": {*_BASE, "numerics", "nn", "optim", "config", "run", "plan", "titan", "speed"},
    "cli": {*_BASE, "numerics", "nn", "optim", "config", "run", "plan", "titan", "speed", "report"},
    "": set(),  # low_bits_training/__init__.py
}
"""Layer (top folder of the package) -> the other layers its modules may import."""

TITAN_ROOMS = ["platform", "targets", "runtime", "launch"]
"""titan/'s rooms by lifecycle (titan/__init__.py): each imports only the rooms before it in this list."""

KNOWN_CIRCLES: list[set[str]] = [
    # Empty, and meant to stay so. A circle that cannot be broken in the change that found it goes here, with
    # the work that breaks it named (module names without the package prefix); any other circle fails. The
    # last one, titan.runtime.numerics.monitor / titan.targets.linear / titan.targets.schedule, went with the
    # plan-target registry
    # (0a4d585).
]
"""Circles tolerated for now: a circle found must be a subset of one of these."""


def imports(package: Path) -> dict[str, set[str]]:
    """``{module: the package's own modules it imports}`` for every ``.py`` file under ``package``, from
    the source (``ast``: module level, inside functions and classes alike; ``TYPE_CHECKING`` blocks too).

    ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, else of ``pkg``
    (its ``__init__``). Names are dotted from the package's own name (``low_bits_training.nn.roles``).
    """
    modules = {_name(package, p): p for p in sorted(package.rglob("*.py"))}
    return {m: _imports_of(m, p, modules) for m, p in modules.items()}


def _name(package: Path, path: Path) -> str:
    parts = [package.name, *path.relative_to(package).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports_of(module: str, path: Path, modules: dict) -> set[str]:
    nodes = ast.walk(ast.parse(path.read_text(), str(path)))
    return set().union(
        *(
            _imports_of_node(module, path, n, modules)
            for n in nodes
            if isinstance(n, (ast.Import, ast.ImportFrom))
        )
    )


def _imports_of_node(module: str, path: Path, node, modules: dict) -> set[str]:
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    if isinstance(node, ast.Import):
        names = {a.name for a in node.names}
    else:
        base = node.module or ""
        if node.level:
            parent = here.split(".")[: len(here.split(".")) - node.level + 1]
            base = ".".join([*parent, *([node.module] if node.module else [])])
        names = {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
    return {m for m in names if m in modules and m != module}


def layer(module: str) -> str:
    """The top folder of a package module (``low_bits_training.nn.roles`` -> ``nn``; the package: ``""``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def room(module: str) -> str | None:
    """The room of a titan module (``low_bits_training.titan.targets.experts`` -> ``plan``); None outside titan."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "titan" else None


def against_the_rooms(graph: dict[str, set[str]], rooms: list[str]) -> list[str]:
    """Every import of a later room of titan (``rooms``' order) by an earlier one, as ``a -> b`` lines."""
    order = {r: i for i, r in enumerate(rooms)}
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if room(a) and room(b) and order.get(room(b), -1) > order.get(room(a), len(rooms))
    )


def against_the_arrow(graph: dict[str, set[str]], may_import: dict[str, set[str]]) -> list[str]:
    """Every import of another layer that ``may_import`` does not allow, as ``a -> b`` lines."""
    return sorted(
        f"{a} -> {b}"
        for a, targets in graph.items()
        for b in targets
        if layer(a) != layer(b) and layer(b) not in may_import.get(layer(a), set())
    )


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The import circles: strongly connected sets of two or more modules (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while (w := stack.pop()) != v:
                group.add(w)
            if group:
                found.append(group | {v})

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _short(modules: set[str]) -> set[str]:
    return {m.partition(".")[2] for m in modules}


def test_imports_go_along_the_arrow():
    assert against_the_arrow(imports(PACKAGE), MAY_IMPORT) == []


def test_every_layer_is_placed():
    assert {layer(m) for m in imports(PACKAGE)} <= set(MAY_IMPORT)


def test_titan_rooms_go_by_lifecycle():
    graph = imports(PACKAGE)
    assert {room(m) for m in graph} - {None} == set(TITAN_ROOMS)
    assert against_the_rooms(graph, TITAN_ROOMS) == []


def test_the_rooms_check_fails_an_import_of_a_later_room():
    graph = {
        "low_bits_training.titan.targets.a": {"low_bits_training.titan.runtime.b", "low_bits_training.nn"}
    }
    assert against_the_rooms(graph, TITAN_ROOMS) == [
        "low_bits_training.titan.targets.a -> low_bits_training.titan.runtime.b"
    ]
    assert against_the_rooms(graph, ["platform", "runtime", "plan", "launch"]) == []


def test_no_import_circle():
    found = [_short(c) for c in circles(imports(PACKAGE))]
    assert [c for c in found if not any(c <= known for known in KNOWN_CIRCLES)] == []


def test_every_module_imports():
    """The fast tier touches every module: each one imports (a syntax error or a broken import fails here)."""
    for module in imports(PACKAGE):
        importlib.import_module(module)


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


TINY = {
    "low/__init__.py": "",
    "low/a.py": "X = 1\n",
    "low/b.py": "from .a import X\n",
    "high/__init__.py": "",
    "high/c.py": "from pkg.low import b\n",
}
TINY_ARROW = {"low": set(), "high": {"low"}, "": set()}
UP = {"pkg.low.a", "pkg.low.b", "pkg.high.c"}
"""An upward import of c from a closes a -> c -> b -> a too."""


def test_the_checker_passes_a_package_that_keeps_the_rules(tmp_path):
    graph = imports(_package(tmp_path, TINY))
    assert graph["pkg.high.c"] == {"pkg.low.b"} and graph["pkg.low.b"] == {"pkg.low.a"}
    assert against_the_arrow(graph, TINY_ARROW) == [] and circles(graph) == []


@pytest.mark.parametrize(
    "extra, arrows, circle",
    [
        ({"low/a.py": "def f():\n    from pkg.high import c\n"}, ["pkg.low.a -> pkg.high.c"], UP),
        ({"low/a.py": "import pkg.high.c\n"}, ["pkg.low.a -> pkg.high.c"], UP),
        ({"low/a.py": "import json\nfrom pkg.high import d\n", "high/d.py": ""}, ["pkg.low.a -> pkg.high.d"],
         None),
        ({"low/a.py": "def f():\n    from . import b\n"}, [], {"pkg.low.a", "pkg.low.b"}),
        ({"high/d.py": "from .c import b\n", "high/c.py": "from pkg.low import b\nfrom . import d\n"}, [],
         {"pkg.high.c", "pkg.high.d"}),
    ],
    ids=["upward-in-a-function", "upward-at-module-level", "upward-alone", "circle-in-a-folder",
         "circle-in-another-folder"],
)  # fmt: skip
def test_the_checker_fails_an_arrow_or_a_circle(tmp_path, extra, arrows, circle):
    graph = imports(_package(tmp_path, {**TINY, **extra}))
    assert against_the_arrow(graph, TINY_ARROW) == arrows
    assert circles(graph) == ([] if circle is None else [circle])


DEFERRED_IMPORTS: dict[str, str] = {}
"""``path module`` -> why, for each import of the package's own modules inside a function: none. Importing
titan puts the CPU adapters and the noise filters in first (``titan/platform/stand.py``), so nothing defers
torchtitan by hand; what is optional (torchao's kernels, matplotlib) is a third-party import and not counted.
An entry here names its file and module and says why it cannot go to the top (113 at issue 41's first step,
80 after its second, 0 now)."""

LONG_FILES = {
    "titan/platform/compat.py": "the one guard of every private torch / torchtitan / torchao name we touch, "
    "each shim beside its digest check: one file by design (DESIGN, 'One guard')",
}
"""Package files over the house's 300 lines, each with why (house style 9)."""


def function_level_imports(package: Path) -> list[str]:
    """``path:line module`` of every import of the package's own modules inside a function."""
    modules = {_name(package, p): p for p in sorted(package.rglob("*.py"))}
    out = []
    for module, path in modules.items():
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                nested = [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
                for node in nested:
                    own = _imports_of_node(module, path, node, modules)
                    out += [f"{path.relative_to(package)}:{node.lineno} {m}" for m in sorted(own)]
    return sorted(set(out))


def test_imports_of_our_own_modules_are_at_the_top_except_the_listed_ones():
    found = function_level_imports(PACKAGE)
    unlisted = [f for f in found if _deferred_key(f) not in DEFERRED_IMPORTS]
    assert not unlisted, "move to the top of the file, or list with why in DEFERRED_IMPORTS:\n" + "\n".join(
        unlisted
    )
    stale = set(DEFERRED_IMPORTS) - {_deferred_key(f) for f in found}
    assert not stale, f"listed in DEFERRED_IMPORTS but no longer inside a function: {sorted(stale)}"


def _deferred_key(found: str) -> str:
    """``cli/x.py:12 low_bits_training.y`` -> ``cli/x.py low_bits_training.y`` (the key of DEFERRED_IMPORTS)."""
    where, module = found.split()
    return f"{where.rpartition(':')[0]} {module}"


def test_the_deferred_imports_check_finds_an_import_inside_a_function(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n    return b\n")
    (pkg / "b.py").write_text("import os\n\n\ndef g():\n    import json\n    return json, os\n")
    assert function_level_imports(pkg) == ["a.py:2 pkg.b"]


def test_files_over_300_lines_are_the_listed_ones():
    long = {
        p.relative_to(PACKAGE).as_posix()
        for p in PACKAGE.rglob("*.py")
        if len(p.read_text().splitlines()) > 300
    }
    assert long == set(LONG_FILES)
