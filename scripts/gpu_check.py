"""The GPU check in one command (``scripts/gpu_check.sh``): what of this package runs on this GPU, in levels,
within ``--budget-s`` seconds (default 480: 8 minutes on one H100 from cold). The checks live in
``low_bits_training/speed/gpu_check/``; this is its entry point.

    scripts/gpu_check.sh --dry-run [--wheelhouse DIR]   # levels, budgets, what it needs and would install
    scripts/gpu_check.sh [--budget-s 480] [--levels 0,1,2,3] [--wheelhouse DIR] [--out DIR]

Only the standard library and torch are imported up front, so it starts on any torch (2.11 included). Exit
code 2 (one line) where an NVIDIA driver is present and torch sees no GPU, or for a bad flag; 1 when a check
fails.
"""

from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout, installed or not


def inductor_cache(environ) -> str:
    """The compiled-kernel cache of this user and stack, so a second run skips compilation:
    ``${XDG_CACHE_HOME:-~/.cache}/low_bits_training/inductor-<torch>-torchao-<torchao>``. Set before the
    package is imported: importing ``torch._dynamo`` fixes ``TORCHINDUCTOR_CACHE_DIR`` to torch's default."""
    root = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "low_bits_training"
    versions = []
    for dist in ("torch", "torchao"):
        try:
            versions.append(metadata.version(dist))
        except metadata.PackageNotFoundError:
            versions.append("none")
    return str(root / f"inductor-{versions[0]}-torchao-{versions[1]}")


def main(argv: list[str] | None = None) -> int:
    """Refuse a driver without CUDA (``--dry-run`` lists anyway), import the check and run it.

    Returns:
        The exit code: 2 refused or a bad flag, 1 a check failed or the check does not import, else 0.
    """
    from low_bits_training.titan.platform.devices import this_machine_refusal  # torch and stdlib only

    argv = sys.argv[1:] if argv is None else argv
    os.environ.setdefault(
        "TORCHINDUCTOR_CACHE_DIR", inductor_cache(os.environ)
    )  # TORCHINDUCTOR_CACHE_DIR wins
    refusal = this_machine_refusal()
    if refusal and "--dry-run" not in argv:
        print(f"gpu_check: {refusal}")
        return 2
    try:
        from low_bits_training.speed.gpu_check import runner
    except Exception as e:  # an older torch: say what does not import
        print(f"gpu_check: low_bits_training.speed does not import on this torch ({type(e).__name__}: {e})")
        return 1
    code = runner.main(argv)
    if refusal:
        print(f"a run here would stop: {refusal}")
    return code


if __name__ == "__main__":
    sys.exit(main())
