"""The package's source and stack as one digest (standard library only, so it can be read before torch is
imported: the test suite keys its compiled-kernel cache with it before any compile is configured).

Two caches use it: the suite's inductor cache folder (tests/conftest.py) and the kept peak plans
(``titan/launch/peak_cache.py``). A changed ``.py`` file of the package, or another Python / torch / torchtitan /
torchao, gives another digest, so entries made by other code are never read.
"""

from __future__ import annotations

import hashlib
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
STACK = ("torch", "torchtitan", "torchao")
"""The distributions whose versions are part of the digest."""


def installed_version(dist: str) -> str:
    """The installed version of ``dist``, or "none"."""
    try:
        return version(dist)
    except PackageNotFoundError:
        return "none"


def source_digest() -> str:
    """sha256 (hex) of Python's version, the versions of ``STACK`` and every ``.py`` file of the package (its
    path and bytes)."""
    h = hashlib.sha256()
    for part in (sys.version, *(f"{d}={installed_version(d)}" for d in STACK)):
        h.update(part.encode() + b"\0")
    for path in sorted(PACKAGE.rglob("*.py")):
        h.update(str(path.relative_to(PACKAGE)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()
