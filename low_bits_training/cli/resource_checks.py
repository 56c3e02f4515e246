"""lbt-doctor's resource rows: are the run's data and tokenizer reachable, how many bytes its training state
takes, is there disk for its checkpoints."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from low_bits_training.cli.checks import Check, check_disk
from low_bits_training.titan.launch.datasets import TOKENIZER_FILES, tokenizer_file
from low_bits_training.titan.launch.memory import peak_check_of

HUB_FREE_DATASETS = ("lbt_markov", "lbt_markov_validation")


def check_dataset(config: Any, env: dict[str, str]) -> Check:
    """Local dataset paths exist; hub datasets need network (a FAIL when HF_HUB_OFFLINE=1)."""
    dl = config.dataloader
    name, path = getattr(dl, "dataset", ""), getattr(dl, "dataset_path", None)
    if name in HUB_FREE_DATASETS:
        return Check(
            "dataset", "OK", f"{name}: built locally in {path or './assets/lbt_markov'} (no network)"
        )
    if path:
        if glob_exists(path):
            return Check("dataset", "OK", f"{name}: local {path}")
        return Check(
            "dataset",
            "FAIL",
            f"{name}: dataloader.dataset_path = {path!r} does not exist",
            "point dataloader.dataset_path at your files",
        )
    if env.get("HF_HUB_OFFLINE") == "1" or env.get("HF_DATASETS_OFFLINE") == "1":
        return Check(
            "dataset",
            "FAIL",
            f"{name}: a hub dataset, but HF_HUB_OFFLINE=1",
            "download it first and set dataloader.dataset_path",
        )
    return Check(
        "dataset",
        "WARN",
        f"{name}: a HF hub name: needs network from every node",
        "pre-download and set dataloader.dataset_path for offline nodes",
    )


def glob_exists(path: str) -> bool:
    """A path, or a glob that matches something."""
    import glob

    return os.path.exists(path) or bool(glob.glob(path))


def check_tokenizer(config: Any) -> Check:
    """Where the tokenizer is (the launcher's validation already refused a folder without one)."""
    # the launcher's: one home

    path = Path(config.hf_assets_path)
    found = tokenizer_file(path)
    if found is None:  # unreachable after build_config; kept so a future loader change cannot pass silently
        return Check(
            "tokenizer", "FAIL", f"hf_assets_path = {str(path)!r}: none of {', '.join(TOKENIZER_FILES)}"
        )
    return Check("tokenizer", "OK", str(found))


def check_state_bytes(budget: Any, why: str | None) -> Check:
    """Bytes per parameter of each training state (params, grads, each optimizer state) and their formats."""
    if budget is None:
        return Check("state bytes", "WARN", f"not computed: {why}", "see docs/memory.md")
    per = budget.per_param()
    parts = ", ".join(
        f"{s} {v:.2f} ({'; '.join(budget.formats[s])})" for s, v in per.items() if s not in ("total", "step")
    )
    total = sum(budget.nbytes.values())
    head = f"{per['total']:.2f} B/param x {budget.numel / 1e6:.2f} M params = {total / 2**30:.2f} GiB on all ranks"
    return Check("state bytes", "OK", f"{head}: {parts}")


def check_peak_memory(config: Any) -> Check:
    """Rank 0's planned peak memory and its parts, against the limit the launcher holds it to (the launcher's
    own check, ``validate.check_peak``: a run over it is the config row's FAIL)."""
    found = peak_check_of(config)
    if found is None or found.plan is None:
        why = found.why_not if found is not None else "not checked"
        return Check("peak memory", "WARN", f"not planned: {why}", "see docs/memory.md")
    return Check("peak memory", "OK", found.line())


def checkpoint_bytes(config: Any, budget: Any) -> int | None:
    """Disk for the kept checkpoints: the parameters and optimizer states of ``budget`` (all but the
    gradients) per checkpoint."""
    if budget is None:
        return None
    ck = config.checkpoint
    count = config.training.steps // max(ck.interval, 1) + 1
    if ck.keep_latest_k > 0:
        count = min(count, ck.keep_latest_k)
    saved = sum(b for s, b in budget.nbytes.items() if s != "grads")
    return saved * max(count, 1)


def check_checkpoint_disk(config: Any, budget: Any) -> Check:
    """Free space where checkpoints go against what the kept checkpoints need."""
    if not config.checkpoint.enable:
        return Check("disk", "OK", "checkpointing off (a killed run cannot resume)")
    folder = Path(config.dump_folder) / config.checkpoint.folder
    return check_disk(folder, checkpoint_bytes(config, budget))
