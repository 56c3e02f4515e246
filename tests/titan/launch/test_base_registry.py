"""One registry of our base configs (titan/launch/bases.py ``__all__``): every base function of the package is
in it, each resolves as ``[job] base`` to our config class, and every preset that names a base of ours names
it there."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from helpers import REPO
from low_bits_training.titan.launch import bases
from low_bits_training.titan.launch.configure import resolve_base
from low_bits_training.titan.runtime.trainer import LowBitsTrainer

PACKAGE = REPO / "low_bits_training"
REGISTRY = "low_bits_training.titan.launch.bases"


def _base_functions() -> set[str]:
    """Module-level functions of the package annotated ``-> Trainer.Config`` (what a base is)."""
    out = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.returns is not None:
                if ast.unparse(node.returns).strip("'\"") == "Trainer.Config":
                    out.add(node.name)
    return out


def test_every_base_function_is_registered():
    assert _base_functions() == set(bases.__all__)


@pytest.mark.parametrize("name", bases.__all__)
def test_each_base_resolves(name):
    assert isinstance(resolve_base(f"{REGISTRY}:{name}"), LowBitsTrainer.Config)


def test_presets_name_our_bases_through_the_registry():
    for path in sorted((REPO / "train_configs").rglob("*.toml")):
        base = tomllib.loads(path.read_text()).get("job", {}).get("base", "")
        if base.startswith("low_bits_training."):
            module, _, fn = base.partition(":")
            assert module == REGISTRY and fn in bases.__all__, (Path(path).name, base)
