"""torchtitan's DCP checkpoint manager plus a manifest per checkpoint: what a resume checks before loading.

Upstream already never picks a half-written checkpoint: a ``step-N`` folder counts only once its ``.metadata``
exists, and DCP writes that file last, through a temporary name and a rename. What upstream does not catch:

- a damaged checkpoint (a file truncated or lost after the write): DCP fails deep inside ``load`` with a
  message about storage offsets. We record every file's size in ``step-N/lbt_manifest.json`` after a
  synchronous save and compare before loading.
- a checkpoint of another run shape: another model, another precision plan, other optimizer state formats.
  Loading those either fails with a tensor-size message or, worse, succeeds and trains on. The manifest holds
  a fingerprint of the model config, the ``[quantize]`` plan and the optimizer param groups; a resume in the
  same run folder with a different fingerprint is refused with both sides named. (To continue a checkpoint
  under another plan on purpose, e.g. bf16 -> fp8, start a new run folder with
  ``--checkpoint.initial_load_path <old>/checkpoint/step-N``.)
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.checkpoint import AsyncMode, CheckpointManager

MANIFEST = "lbt_manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed; the message says which and why in one line."""


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
    if isinstance(v, (bool, int, float, str)) or v is None:
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
        "quantize": _plain(getattr(config, "quantize", None)),
        "optimizer": {"class": type(config.optimizer).__qualname__, "param_groups": groups},
    }


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
    return None if a == b else f"{where}: checkpoint has {a!r}, this run has {b!r}"


def write_manifest(path: str, fp: dict[str, Any]) -> None:
    """Record every file's size and the run fingerprint in ``path/lbt_manifest.json`` (atomically)."""
    files = {}
    for root, _, names in os.walk(path):
        for n in names:
            if n != MANIFEST and not n.endswith(".tmp"):
                full = os.path.join(root, n)
                files[os.path.relpath(full, path)] = os.path.getsize(full)
    tmp = os.path.join(path, MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"files": files, "fingerprint": fp}, f, indent=1)
    os.replace(tmp, os.path.join(path, MANIFEST))


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


class LowBitsCheckpointManager(CheckpointManager):
    """CheckpointManager that writes a manifest after each synchronous save and verifies it before a load."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        verify_on_load: bool = True
        """Check file sizes and the run fingerprint (model, plan, optimizer) before resuming."""

    fingerprint: dict[str, Any] | None = None  # set by the trainer once its config is known

    def __init__(self, config: Config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.verify_on_load = config.verify_on_load

    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        saved = super()._save(curr_step, last_step)
        if (
            saved
            and self.async_mode == AsyncMode.DISABLED
            and self._is_rank0()
            and self.fingerprint is not None
        ):
            path = self._create_checkpoint_id(curr_step)
            if os.path.isfile(os.path.join(path, ".metadata")):
                write_manifest(path, self.fingerprint)
        return saved

    def _load(self, step: int = -1) -> bool:
        if self.verify_on_load and os.path.isdir(self.folder):
            load_step = self._find_load_step() if step == -1 else step
            if load_step >= 0:
                verify(self._create_checkpoint_id(load_step), self.fingerprint)
        return super()._load(step)

    @staticmethod
    def _is_rank0() -> bool:
        return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
