"""Datasets the project adds to torchtitan's text dataloader, and the step that makes their files.

torchtitan 0.3.0 keeps its text datasets in ``torchtitan.hf_datasets.text_datasets.DATASETS`` ("Add your
dataset here"): we add three names there.

- ``lbt_markov`` / ``lbt_markov_validation``: the synthetic Markov corpus of ``low_bits_training.data.markov``
  (made locally, known loss floor). ``dataset_path`` is its folder (default ``./assets/lbt_markov``).
- ``local``: the user's own files: ``dataset_path`` is a file, a glob or a folder of ``.txt`` (one document
  per line), ``.json``/``.jsonl`` or ``.parquet`` files with a ``text`` column.

Hub datasets (``c4`` ...) stay available to users with a network, as torchtitan has them.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

from low_bits_training.data.markov import build_corpus
from low_bits_training.errors import ConfigError

MARKOV_DEFAULT_PATH = "./assets/lbt_markov"
TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")
"""The files torchtitan's HuggingFaceTokenizer loads a tokenizer from, in the order it looks for them."""
_LOADERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


class TokenizerMissing(ConfigError):
    """``hf_assets_path`` holds none of ``TOKENIZER_FILES``: the launcher refuses it like any config error
    (exit 2); ``lbt-doctor`` and ``lbt-speed`` tell it apart to still show the plan (``cli/config_checks.py``
    ``resolve_run``)."""


def tokenizer_file(folder: str | os.PathLike) -> Path | None:
    """The first of ``TOKENIZER_FILES`` in ``folder`` (an ``hf_assets_path``), or None."""
    return next((Path(folder) / f for f in TOKENIZER_FILES if (Path(folder) / f).is_file()), None)


def _markov_loader(split: str):
    def load(path: str):
        from datasets import load_dataset

        return load_dataset("json", data_files=str(Path(path) / f"{split}.jsonl"), split="train")

    return load


def local_files(path: str) -> tuple[str, list[str]]:
    """The ``datasets`` builder name and file list for a local file, glob or folder.

    Raises:
        ConfigError: nothing matches, or the files mix or use unsupported kinds.
    """
    p = Path(path)
    files = sorted(str(f) for f in p.iterdir() if f.is_file()) if p.is_dir() else sorted(glob.glob(path))
    files = [f for f in files if Path(f).suffix in _LOADERS]
    if not files:
        raise ConfigError(f"dataloader.dataset_path = {path!r}: no {'/'.join(_LOADERS)} files found")
    kinds = {_LOADERS[Path(f).suffix] for f in files}
    if len(kinds) > 1:
        raise ConfigError(f"dataloader.dataset_path = {path!r}: mixes file kinds {sorted(kinds)}; use one")
    return kinds.pop(), files


def _local_loader(path: str):
    from datasets import load_dataset

    kind, files = local_files(path)
    return load_dataset(kind, data_files=files, split="train")


def register() -> None:
    """Add the project's datasets to torchtitan's table (idempotent)."""
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS

    def text(sample):
        return sample["text"]

    for name, loader in (
        ("lbt_markov", _markov_loader("train")),
        ("lbt_markov_validation", _markov_loader("validation")),
        ("local", _local_loader),
    ):
        path = "" if name == "local" else MARKOV_DEFAULT_PATH
        DATASETS[name] = DatasetConfig(path=path, loader=loader, sample_processor=text)


def dataset_configs(config) -> list[tuple[str, object]]:
    """``(TOML key, dataloader config)`` of every dataloader that reads a named text dataset."""
    out = [("dataloader", config.dataloader)]
    if getattr(config.validator, "enable", False) and hasattr(config.validator, "dataloader"):
        out.append(("validator.dataloader", config.validator.dataloader))
    return [(k, d) for k, d in out if hasattr(d, "dataset")]


def check_names(config) -> None:
    """Every configured dataset is one torchtitan's text dataloader knows (ours registered first).

    Raises:
        ConfigError: an unknown name (torchtitan would stop on it in every rank, after building the model).
    """
    from torchtitan.hf_datasets.text_datasets import DATASETS

    register()
    for key, dl in dataset_configs(config):
        if dl.dataset not in DATASETS:
            raise ConfigError(
                f"{key}.dataset = {dl.dataset!r}: expected one of {', '.join(sorted(DATASETS))}"
            )


def prepare_assets(config) -> None:
    """Make the files the configured datasets need and check local paths, before anything is built.

    The Markov corpus is built (once, deterministically) in its ``dataset_path``; when ``hf_assets_path``
    does not exist and a Markov dataset is used, the corpus's own tokenizer is used.

    Raises:
        ConfigError: a dataset name torchtitan does not know, a ``local`` dataset without files, or a
            tokenizer folder that does not exist.
    """
    check_names(config)
    for _, dl in dataset_configs(config):
        if dl.dataset.startswith("lbt_markov"):
            dl.dataset_path = dl.dataset_path or MARKOV_DEFAULT_PATH
            build_corpus(dl.dataset_path)
            if not os.path.exists(config.hf_assets_path):
                config.hf_assets_path = dl.dataset_path
        elif dl.dataset == "local":
            if not dl.dataset_path:
                raise ConfigError(
                    "dataloader.dataset = 'local' needs dataloader.dataset_path (file, glob or folder)"
                )
            local_files(dl.dataset_path)
    if tokenizer_file(config.hf_assets_path) is None:
        raise TokenizerMissing(
            f"hf_assets_path = {config.hf_assets_path!r}: none of {', '.join(TOKENIZER_FILES)} there "
            "(use a local HF tokenizer folder, or dataset 'lbt_markov' for the built-in one)"
        )
