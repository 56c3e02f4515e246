"""The manifest written next to each checkpoint (``step-N/lbt_manifest.json``): every file's size and the
run's fingerprint (model config, ``[quantize]`` plan, optimizer param groups), and the check a resume runs
against it (``titan.runtime.checkpoint`` writes and verifies it)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

from low_bits_training.run.exits import CheckpointError  # its exit code: run/exits.py
from low_bits_training.run.folder import write_atomic

MANIFEST = "lbt_manifest.json"


def _plain(v: Any) -> Any:
    # Keep what describes the run's shape; drop reprs of callables (they hold memory addresses).
    if dataclasses.is_dataclass(v):
        # A quantized layer's own ``plan`` is left out: the ``quantize`` section names the plan once, and a
        # mismatch is then reported as ``quantize.<key>`` rather than deep inside the model tree.
        names = [f.name for f in dataclasses.fields(v) if not f.name.startswith("_") and f.name != "plan"]
        return {n: _plain(getattr(v, n)) for n in names}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, str):
        return str(v)  # a StrEnum as its plain value, as the manifest's JSON holds it
    if isinstance(v, (bool, int, float)) or v is None:
        return v
    return type(v).__name__


def _group_shape(group) -> dict[str, Any]:
    # Which optimizer and which state formats (string-valued kwargs such as "int8_block128"); numbers such as
    # lr or weight_decay may change on a resume, so they are not part of the shape.
    kwargs = getattr(group, "optimizer_kwargs", {}) or {}
    return {
        "pattern": getattr(group, "pattern", None),
        "optimizer_name": getattr(group, "optimizer_name", None),
        "formats": {k: v for k, v in sorted(kwargs.items()) if isinstance(v, str)},
    }


def fingerprint(config) -> dict[str, Any]:
    """What a checkpoint must match to be resumed: model architecture, precision plan, optimizer groups."""
    model = config.model_spec.model if config.model_spec is not None else None
    groups = [_group_shape(g) for g in getattr(config.optimizer, "param_groups", [])]
    return {
        "model": {"flavor": getattr(config.model_spec, "flavor", None), "config": _plain(model)},
        "quantize": _quantize_shape(getattr(config, "quantize", None)),
        "optimizer": {"class": type(config.optimizer).__qualname__, "param_groups": groups},
    }


def _quantize_shape(quantize) -> Any:
    # The plan's shape: its evaluation plan is not (validation changes no state), and a schedule appears only
    # when there is one, so checkpoints written before schedules existed still resume (plan/schedule.py).
    # Every phase of one schedule has the same fingerprint: a run resumes in whatever phase it stopped in.
    out = _plain(quantize)
    if isinstance(out, dict):
        out.pop("eval", None)
        if not out.get("phases"):
            out.pop("phases", None)
    return out


def _first_difference(a: Any, b: Any, where: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            d = _first_difference(a.get(k), b.get(k), f"{where}.{k}" if where else k)
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return next(
            (
                d
                for i, (x, y) in enumerate(zip(a, b, strict=True))
                if (d := _first_difference(x, y, f"{where}[{i}]"))
            ),
            None,
        )
    if isinstance(a, list) and isinstance(b, list):
        return f"{where}: checkpoint has {len(a)} entries, this run has {len(b)}"
    return None if a == b else f"{where}: checkpoint has {_short(a)}, this run has {_short(b)}"


def _short(v: Any, limit: int = 80) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def write_manifest(path: str, fp: dict[str, Any]) -> None:
    """Record every file's size and the run fingerprint in ``path/lbt_manifest.json`` (atomically)."""
    files = {}
    for root, _, names in os.walk(path):
        for n in names:
            if n != MANIFEST and not n.endswith(".tmp"):
                full = os.path.join(root, n)
                files[os.path.relpath(full, path)] = os.path.getsize(full)
    write_atomic(os.path.join(path, MANIFEST), json.dumps({"files": files, "fingerprint": fp}, indent=1))


def verify(path: str, fp: dict[str, Any] | None) -> None:
    """Check a checkpoint folder against its manifest and the current run's fingerprint.

    Raises:
        CheckpointError: a file missing or of another size, or a fingerprint that differs (first difference
            named). A checkpoint without a manifest (written elsewhere, or async) is not checked.
    """
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return
    for name, size in manifest["files"].items():
        full = os.path.join(path, name)
        actual = os.path.getsize(full) if os.path.exists(full) else None
        if actual != size:
            raise CheckpointError(
                f"checkpoint {path} is damaged: {name} has {actual} bytes, {size} were written; "
                "delete this step folder to resume from the one before"
            )
    diff = _first_difference(manifest["fingerprint"], fp) if fp is not None else None
    if diff:
        raise CheckpointError(
            f"checkpoint {path} belongs to another run shape ({diff}); use another "
            "dump_folder, or --checkpoint.initial_load_path to start from it on purpose"
        )
