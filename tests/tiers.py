"""Which tests are slow, decided from what they call (never marked by hand, so none is forgotten).

A test is slow when its body, the body of any fixture it uses, or the body of any function of the test
folder that these call (followed through any depth) calls one of:

- train through the launcher: ``helpers.train`` / ``helpers.train_command`` (torchrun, a model, seconds to
  minutes), or the launcher's own runners (``cli.runner.run_local``, ``cli.sweep.run_points``, and the
  ``main`` of ``lbt-sweep`` / ``lbt-scaling``, which train or submit every point unless told ``--collect``);
- start a process: anything of ``subprocess`` or ``torch.multiprocessing`` (``mp.spawn``; an interpreter
  start imports torch: seconds);
- compile: ``torch.compile`` or a module's ``.compile()`` (inductor: 5-80 s a test on 2 cores), or an
  optimizer built with ``fused=True`` (its update is compiled, ``optim/fused.py``): the keyword written in a
  call, or a parameter ``fused`` that is True.

Only calls count (a function named in a parametrize list is not called by the test). Names are resolved
as the test sees them, its own imports included (``from helpers import train as t`` is found,
``re.compile`` is not ``torch.compile``). What a library function does inside is not followed: only the
test folder's own code is read. ``tests/test_tiers.py`` holds the rule to small examples.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable, Iterable
from pathlib import Path

TESTS = Path(__file__).resolve().parent
FUSED_KEYWORD = "fused"
"""``LowBitAdamW(..., fused=True)``: a keyword whose constant True means a compiled optimizer update."""


def slow_objects() -> dict[int, str]:
    """``{id(object): why}`` for the objects whose use makes a test slow (see the module docstring)."""
    import torch
    import torch.multiprocessing

    import helpers
    from low_bits_training.cli import runner, scaling, sweep

    named = {
        helpers.train: "trains through the launcher (helpers.train)",
        helpers.train_command: "starts the launcher (helpers.train_command)",
        runner.run_local: "trains through the launcher (cli.runner.run_local)",
        sweep.run_points: "trains through the launcher (cli.sweep.run_points)",
        sweep.main: "trains or submits each point (cli.sweep.main)",
        scaling.main: "trains or submits each point (cli.scaling.main)",
        subprocess: "starts a process (subprocess)",
        torch.multiprocessing: "starts processes (torch.multiprocessing)",
        torch.compile: "compiles (torch.compile)",
    }
    for module, names in (
        (subprocess, ("run", "Popen", "call", "check_call", "check_output")),
        (torch.multiprocessing, ("spawn", "start_processes")),
    ):  # imported by name (``from subprocess import run``)
        named.update({getattr(module, n): named[module] for n in names})
    return {id(obj): why for obj, why in named.items()}


def slow_reason(
    functions: Iterable[Callable], slow: dict[int, str] | None = None, params: dict | None = None
) -> str | None:
    """Why a test that runs ``functions`` (its own function and its fixtures') is slow; None: it is not.

    Args:
        functions: Python functions; only those defined under ``tests/`` are read (and followed).
        slow: ``slow_objects()`` (computed once by the caller when it asks for many tests).
        params: the test's parameters (``item.callspec.params``): ``fused=True`` there compiles too.

    Returns:
        The first reason found (``"compiles (torch.compile) in test_x"``), or None.
    """
    if (params or {}).get(FUSED_KEYWORD) is True:
        return f"compiles (parametrized with {FUSED_KEYWORD}=True)"
    slow = slow_objects() if slow is None else slow
    seen: set[int] = set()
    todo = [f for f in functions if _ours(f)]
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        why, called = _read(fn, slow)
        if why:
            return f"{why} in {fn.__qualname__}"
        todo += [f for f in called if id(f) not in seen]
    return None


def _ours(obj: object) -> bool:
    # A Python function written in the test folder (not a library's, not a builtin).
    fn = inspect.unwrap(obj) if callable(obj) else obj
    if not isinstance(fn, types.FunctionType):
        return False
    try:
        return Path(fn.__code__.co_filename).resolve().is_relative_to(TESTS)
    except (OSError, ValueError):
        return False


def _read(fn: types.FunctionType, slow: dict[int, str]) -> tuple[str | None, list[Callable]]:
    """(why ``fn``'s own source is slow or None, the test-folder functions it names); read once per function
    (a fixture or a helper serves many tests)."""
    key = (id(fn), id(slow))
    if key not in _READ:
        _READ[key] = _read_source(inspect.unwrap(fn), slow)
    return _READ[key]


_READ: dict[tuple[int, int], tuple[str | None, list[Callable]]] = {}


def _read_source(fn: types.FunctionType, slow: dict[int, str]) -> tuple[str | None, list[Callable]]:
    try:
        (tree,) = ast.parse(textwrap.dedent(inspect.getsource(fn))).body
    except (OSError, TypeError, SyntaxError, ValueError):
        return None, []
    called: list[Callable] = []
    nodes = [n for stmt in tree.body for n in ast.walk(stmt)]  # the body: not the decorators
    scope = {**fn.__globals__, **_imported(nodes)}
    for node in nodes:
        if not isinstance(node, ast.Call):
            continue
        if any(k.arg == FUSED_KEYWORD and isinstance(k.value, ast.Constant) and k.value.value is True
               for k in node.keywords):  # fmt: skip
            return "compiles (an optimizer with fused=True)", []
        if _module_compile(node.func, scope):
            return "compiles (a module's .compile())", []
        obj = _resolve(node.func, scope)
        owner = _resolve(node.func.value, scope) if isinstance(node.func, ast.Attribute) else None
        for o in (obj, owner):  # subprocess.run, or any call on a slow module (mp.Process)
            if id(o) in slow:
                return slow[id(o)], []
        if _ours(obj):
            called.append(obj)
    return None, called


_MISSING = object()


def _imported(nodes: list[ast.AST]) -> dict[str, object]:
    # The names a function body imports itself (``import subprocess`` inside a test), as it would bind them.
    out: dict[str, object] = {}
    for node in nodes:
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name if a.asname else a.name.partition(".")[0]
                out[a.asname or top] = _module(top if not a.asname else a.name)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            module = _module(node.module)
            for a in node.names:
                out[a.asname or a.name] = getattr(module, a.name, _MISSING)
    return out


def _module(name: str) -> object:
    # Only a module already imported: reading a test must not import anything (side effects, seconds).
    return sys.modules.get(name, _MISSING)


def _module_compile(func: ast.AST, scope: dict) -> bool:
    # ``block.compile(...)``: torch.nn.Module.compile, torch.compile in place. ``re.compile`` is a module's.
    return (
        isinstance(func, ast.Attribute)
        and func.attr == "compile"
        and not isinstance(_resolve(func.value, scope), types.ModuleType)
    )


def _resolve(node: ast.AST, scope: dict) -> object:
    # The object a name or a dotted attribute (``torch.compile``, ``mp.spawn``) denotes in the module's scope.
    if isinstance(node, ast.Name):
        return scope.get(node.id, _MISSING)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, scope)
        if isinstance(base, types.ModuleType):
            return getattr(base, node.attr, _MISSING)
    return _MISSING
