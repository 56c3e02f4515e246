"""``LBT_TORCH=keep`` (``scripts/ensure_venv.sh``): install the package around the torch this node already has.

    python scripts/keep_torch.py PYPROJECT [EXTRA]

Run by the interpreter of the venv being set up (made with ``--system-site-packages``, so it sees the node's
torch). Prints, one per line: first the pip constraint that pins torch to the version installed here (pip
then cannot replace it), then every dependency of the package and of ``EXTRA`` but torch, read from
``pyproject.toml`` (the one list). Refuses in one line, exit code 2, when no torch is installed, when the venv
has a torch of its own (not the node's), or when the node's torch is older than the package's pin: torchtitan
0.3.0 calls APIs torch 2.13 lacks (DESIGN.md "Pinned stack"; only the pure layers formats / numerics / nn /
optim / speed run from torch 2.11, ``scripts/torch_range.sh``).

Standard library only: it runs before the package is installed.
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib import metadata
from pathlib import Path

PREFIX = "low-bits-training: config error: LBT_TORCH=keep"
"""How every refusal starts."""


class Refused(Exception):
    """One line: why the node's torch cannot be kept."""


def name_of(requirement: str) -> str:
    """A requirement's project name, normalized (``"Torch>=2"`` -> ``"torch"``)."""
    found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    return re.sub(r"[-_.]+", "-", found.group(1)).lower() if found else ""


def release(version: str) -> tuple[int, ...]:
    """The release numbers of a version (``"2.14.1+cu126"`` -> ``(2, 14, 1)``, ``"2.14.0a0+git"`` -> ``(2, 14, 0)``)."""
    found = re.match(r"\d+(\.\d+)*", version.strip())
    return tuple(int(x) for x in found.group(0).split(".")) if found else ()


def requirements(pyproject: dict, extra: str | None) -> list[str]:
    """The package's dependencies and ``extra``'s, as pyproject.toml lists them.

    Raises:
        Refused: ``extra`` is not one of the package's extras.
    """
    project = pyproject["project"]
    extras = project.get("optional-dependencies", {})
    if extra and extra not in extras:
        raise Refused(f"{PREFIX}: extra {extra!r} is not one of {', '.join(sorted(extras))}")
    return [*project["dependencies"], *(extras[extra] if extra else [])]


def torch_floor(reqs: list[str]) -> str:
    """The torch version the package pins (``torch==2.14.1`` -> ``"2.14.1"``): the oldest it runs on."""
    for req in reqs:
        if name_of(req) == "torch":
            found = re.search(r"(==|>=|~=)\s*([0-9][^,;\s]*)", req)
            if found:
                return found.group(2)
    raise Refused(f"{PREFIX}: pyproject.toml pins no torch version")


def plan(pyproject: dict, extra: str | None, installed: str | None, own: bool) -> list[str]:
    """The constraint and the requirements to install (see the module docstring).

    Args:
        pyproject: pyproject.toml, parsed.
        extra: an optional-dependencies name (``"dev"``) or None.
        installed: the torch version installed here (None: none).
        own: that torch is the venv's own, not the node's (system site-packages).

    Raises:
        Refused: one line naming what was found and what is allowed.
    """
    reqs = requirements(pyproject, extra)
    floor = torch_floor(reqs)
    fix = f"install a torch >= {floor} built for this node's CUDA first (README 'Setup on a GPU machine')"
    if installed is None:
        raise Refused(
            f"{PREFIX}: no torch is installed for {sys.executable}; allowed: torch >= {floor}: {fix}"
        )
    if own:
        raise Refused(
            f"{PREFIX}: the venv has a torch of its own ({installed}), not the node's; allowed: the node's "
            "torch: remove the venv (rm -r .venv) and set up again"
        )
    if release(installed) < release(floor):
        raise Refused(
            f"{PREFIX}: this node's torch is {installed}; allowed: torch >= {floor} (torchtitan 0.3.0 needs "
            f"it): {fix}, or leave LBT_TORCH unset for the registry's torch=={floor}"
        )
    return [f"torch=={installed}", *(r for r in reqs if name_of(r) != "torch")]


def installed_torch() -> tuple[str | None, bool]:
    """The torch version installed for this interpreter (None: none) and whether it lies inside this venv
    (``sys.prefix``, when that is a venv) rather than in the node's site-packages."""
    try:
        dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return None, False
    where = Path(str(dist.locate_file(""))).resolve()
    venv = Path(sys.prefix).resolve()
    own = sys.prefix != sys.base_prefix and venv in (where, *where.parents)
    return dist.version, own


def main(argv: list[str]) -> int:
    """Print the constraint and the requirements; a refusal is one line on stderr and exit code 2."""
    if len(argv) not in (1, 2):
        print("usage: keep_torch.py PYPROJECT [EXTRA]", file=sys.stderr)
        return 2
    pyproject = tomllib.loads(Path(argv[0]).read_text())
    try:
        lines = plan(pyproject, argv[1] if len(argv) == 2 else None, *installed_torch())
    except Refused as e:
        print(e, file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
