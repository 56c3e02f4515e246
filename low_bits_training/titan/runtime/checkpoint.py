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
- a data position written by another number of data-parallel ranks: torchtitan stops on a bare assertion.
  We refuse it with the way out (exclude the data loader), and say plainly at start when the data restarts.

The launcher runs the same checks (``preflight``) before any rank starts, so a refused resume touches nothing
in the run folder; the ranks check again before loading (a checkpoint may change in between).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchtitan.components.checkpoint import AsyncMode, CheckpointManager
from torchtitan.tools.logging import logger

from low_bits_training.run.exits import CheckpointError  # its exit code: run/exits.py
from low_bits_training.run.folder import write_atomic
from low_bits_training.titan.platform.compat import CheckpointHooks, checkpoint_path, find_load_step
from low_bits_training.titan.platform.ranks import is_rank0

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


def data_ranks(path: str) -> int | None:
    """How many data-parallel ranks wrote the data loader state of checkpoint ``path`` (None: it has none).

    torchtitan saves one ``dataloader.dp_rank_<i>`` entry per data-parallel rank (components/dataloader.py
    ``state_dict``); DCP's ``.metadata`` lists them without reading the data.
    """
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    ranks = {k.split(".")[1] for k in keys if k.startswith("dataloader.dp_rank_")}
    return len(ranks) or None


def check_data_position(path: str, data_ranks_now: int, excluded: list[str]) -> str | None:
    """Whether the data continues where checkpoint ``path`` stopped on ``data_ranks_now`` data-parallel ranks.

    torchtitan keeps the data position per rank (each rank reads its own contiguous slice of the corpus) and
    cannot move it to another number of ranks; with ``exclude_from_loading = ["dataloader"]`` the run starts
    the data again from the first batch.

    Returns:
        None when the data continues, else the notice to log at start (the data restarts, and why).

    Raises:
        CheckpointError: the checkpoint's data position was written by another number of ranks and is not
            excluded, which torchtitan would stop on deep inside the load.
    """
    saved = data_ranks(path)
    if "dataloader" in excluded:
        why = f"written by {saved} data-parallel rank(s), " if saved and saved != data_ranks_now else ""
        return (
            f"resuming {path} ({why}checkpoint.exclude_from_loading has 'dataloader'): the data restarts from "
            "the first batch, so the next steps train on batches this run has seen already"
        )
    if saved is not None and saved != data_ranks_now:
        raise CheckpointError(
            f"checkpoint {path} holds the data position of {saved} data-parallel rank(s), this run has "
            f"{data_ranks_now}: torchtitan cannot move it to another number of ranks; resume with "
            "--checkpoint.exclude_from_loading dataloader (the data then restarts from the first batch)"
        )
    return None


def resume_path(config) -> str | None:
    """The checkpoint folder a run will resume from, as torchtitan picks it (None: a fresh start).

    Raises:
        CheckpointError: ``checkpoint.load_step`` names a step that is not there.
    """
    ck = config.checkpoint
    if not ck.enable:
        return None
    folder = os.path.join(config.dump_folder, ck.folder)
    if ck.load_step != -1:
        path = checkpoint_path(folder, ck.load_step)
        if not os.path.isdir(path):
            raise CheckpointError(f"checkpoint.load_step = {ck.load_step}: no checkpoint at {path}")
        return path
    step = find_load_step(folder)
    return checkpoint_path(folder, step) if step >= 0 else None


def preflight(config, fp: dict[str, Any] | None, data_ranks_now: int) -> str | None:
    """Check, before any rank starts, the checkpoint this run would resume from (what ``_load`` checks).

    Args:
        config: the resolved config.
        fp: this run's fingerprint (``fingerprint`` of the config as the trainer will hold it).
        data_ranks_now: this run's data-parallel degree.

    Returns:
        The path it resumes from, or None for a fresh start.

    Raises:
        CheckpointError: damaged, of another run shape, or a data position that cannot be moved.
    """
    path = resume_path(config)
    if path is None or os.path.basename(path) == "step-0":  # step 0 holds the model only
        return path
    if getattr(config.checkpoint, "verify_on_load", True):
        verify(path, fp)
    check_data_position(path, data_ranks_now, list(config.checkpoint.exclude_from_loading))
    return path


def _root_message(error: BaseException) -> str:
    # DCP wraps each rank's failure (CheckpointException: "ranks: dict_keys([0])" + tracebacks); the first
    # line of the innermost cause says what went wrong (EOFError on a truncated file, a size mismatch, ...).
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = next(iter(failures.values()))  # (exception, traceback) per rank
        error = inner[0] if isinstance(inner, tuple) else inner
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}{': ' + text if text else ''}"


class LowBitsCheckpointManager(CheckpointHooks, CheckpointManager):
    """CheckpointManager that writes a manifest after each synchronous save and verifies it before a load;
    a load it cannot do ends in one ``CheckpointError`` line."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        verify_on_load: bool = True
        """Check file sizes and the run fingerprint (model, plan, optimizer) before resuming."""

    fingerprint: dict[str, Any] | None = None  # set by the trainer once its config is known
    on_start: Callable[[], None] | None = None
    """Called once, after the checkpoint (if any) was loaded: the run has really started."""

    def __init__(self, config: Config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.verify_on_load = config.verify_on_load

    def after_save(self, step: int) -> None:
        if self.async_mode == AsyncMode.DISABLED and is_rank0() and self.fingerprint is not None:
            path = checkpoint_path(self.folder, step)
            if os.path.isfile(os.path.join(path, ".metadata")):
                write_manifest(path, self.fingerprint)

    def before_load(self, step: int) -> None:
        path = self._path_to_load(step)
        if path is None:
            return
        if self.verify_on_load:
            verify(path, self.fingerprint)
        notice = check_data_position(path, self._data_ranks(), list(self.exclude_from_loading))
        if notice and is_rank0():
            logger.warning(f"low-bits-training: {notice}")

    def after_load(self, loaded: bool) -> None:
        start, self.on_start = self.on_start, None
        if start is not None:
            start()

    def load_error(self, error: BaseException) -> BaseException:
        if isinstance(error, CheckpointError):
            return error
        first = _root_message(error)
        return CheckpointError(f"checkpoint in {self.folder} cannot be loaded: {first}")

    def _path_to_load(self, step: int) -> str | None:
        load_step = (
            (find_load_step(self.folder) if os.path.isdir(self.folder) else -1) if step == -1 else step
        )
        if load_step <= 0:  # none, or step 0 (model only, no data position)
            return None
        return checkpoint_path(self.folder, load_step)

    def _data_ranks(self) -> int:
        loader = self.states.get("dataloader")
        return getattr(loader, "dp_world_size", 1)
