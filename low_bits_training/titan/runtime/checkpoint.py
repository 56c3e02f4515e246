"""torchtitan's DCP checkpoint manager plus a manifest per checkpoint: what a resume checks before loading.

Upstream already never picks a half-written checkpoint: a ``step-N`` folder counts only once its ``.metadata``
exists, and DCP writes that file last, through a temporary name and a rename. What upstream does not catch:

- a damaged checkpoint (a file truncated or lost after the write): DCP fails deep inside ``load`` with a
  message about storage offsets. We record every file's size in ``step-N/lbt_manifest.json`` after a
  synchronous save and compare before loading (``titan.runtime.manifest``).
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

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torchtitan.components.checkpoint import AsyncMode, CheckpointManager
from torchtitan.tools.logging import logger

from low_bits_training.run.exits import CheckpointError  # its exit code: run/exits.py
from low_bits_training.titan.platform.compat import CheckpointHooks, checkpoint_path, find_load_step
from low_bits_training.titan.platform.ranks import is_rank0
from low_bits_training.titan.runtime.manifest import verify, write_manifest


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
