"""Test session setup: CPU adapters before any torchtitan import, the inductor cache, the two tiers.

Tiers (README, "The two commands"): ``./run_tests.sh`` runs ``-m "not slow or smoke"``, every unit test plus
the one launcher run marked ``smoke``; ``./run_tests.sh --all`` (and CI) runs everything. The ``slow`` mark
is given here, at collection, by the rule in ``tiers.py`` (what a test calls: the training helper, a
process, a compile), never by hand.
"""

import json
import os
from pathlib import Path

import pytest

from low_bits_training.source import installed_version, source_digest  # standard library only: no torch yet

PACKAGE = Path(__file__).resolve().parents[1] / "low_bits_training"
CHECKOUT_OWNED = [PACKAGE.parent / "outputs", PACKAGE.parent / "assets"]
"""The checkout's folders the README's first command fills (run folders; the built-in corpus): tests never
read or write them (the README's two commands pass in its order on a fresh clone, issue 41)."""


def inductor_cache_dir() -> Path:
    """The compiled-kernel cache of this source: ``$XDG_CACHE_HOME/lbt-inductor/<key>`` (default
    ``~/.cache``), the key ``low_bits_training.source``'s digest of the versions of Python, torch, torchtitan and
    torchao and of every ``.py`` file of the package. A rerun of the same source reuses its kernels; a changed
    source or stack starts a new folder, so entries of another source never mix in (../shared/DESIGN.md: stale
    entries crash torchao's low-bit optimizers). Old folders stay until deleted (``rm -r ~/.cache/lbt-inductor``)."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "lbt-inductor" / source_digest()[:16]


# A test (or a caller) that sets its own cache keeps it; the training runs tests start inherit this one.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache_dir()))
# Peak-memory plans kept between the launcher starts of the suite (titan/launch/peak_cache.py: keyed by the
# source and by what the planner reads, so a test that changes a run's shape is planned again).
os.environ.setdefault(
    "LBT_PEAK_CACHE", str(Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).parents[1] / "lbt-peak")
)
os.environ.setdefault("OMP_NUM_THREADS", "2")

from low_bits_training.titan.platform import cpu  # noqa: E402

if cpu.needs_cpu_adapters() and installed_version("torchtitan") != "none":
    cpu.install_device_module()


def checkout_state() -> dict[str, tuple[int, int]]:
    """``{path: (size, mtime_ns)}`` of every file and folder under ``CHECKOUT_OWNED``."""
    out = {}
    for top in CHECKOUT_OWNED:
        for folder, dirs, files in os.walk(top):
            for name in [*dirs, *files, ""]:
                path = os.path.join(folder, name)
                try:
                    st = os.stat(path)
                except FileNotFoundError:  # removed while walking: the comparison shows it
                    continue
                out[path] = (st.st_size if name in files else 0, st.st_mtime_ns)
    return out


@pytest.fixture(autouse=True)
def corpus_outside_the_checkout(monkeypatch):
    """In this process, a preset's built-in corpus (``dataset_path = "./assets/lbt_markov"``, relative to the
    checkout where pytest runs) is built and read in the test corpus (``helpers.CORPUS``) instead: the
    launcher's own check (``worker.build_config`` -> ``datasets.prepare_assets``), which doctor, lbt-speed
    and the in-process launcher tests run, never writes the checkout's ``assets/``. Training runs in
    subprocesses get ``--dataloader.dataset_path`` from ``helpers.SMALL``."""
    from helpers import CORPUS
    from low_bits_training.titan.launch import datasets

    real, assets = datasets.prepare_assets, CHECKOUT_OWNED[1].resolve()

    def prepare(config) -> None:
        for _, dl in datasets.dataset_configs(config):
            path = dl.dataset_path or datasets.MARKOV_DEFAULT_PATH
            if dl.dataset.startswith("lbt_markov") and Path(path).resolve().is_relative_to(assets):
                dl.dataset_path = str(CORPUS)
        real(config)

    monkeypatch.setattr(datasets, "prepare_assets", prepare)


@pytest.fixture(autouse=True)
def leaves_the_checkout_alone():
    """Fail a test after which the checkout's ``outputs/`` or ``assets/`` differ from before it."""
    before = checkout_state()
    yield
    after = checkout_state()
    if after != before:
        changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
        pytest.fail(f"the test changed the checkout's outputs/ or assets/: {', '.join(changed[:5])}")


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection reads the marks
def pytest_collection_modifyitems(config, items) -> None:
    """Mark ``slow`` every test that ``tiers.slow_reason`` finds slow (its function and its fixtures')."""
    from tiers import slow_objects, slow_reason

    slow = slow_objects()
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        fixtures = [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]
        params = item.callspec.params if hasattr(item, "callspec") else None
        if slow_reason([item.function, *fixtures], slow, params):
            item.add_marker(pytest.mark.slow)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items[:] = longest_files_first(items)


FILE_SECONDS = Path(__file__).with_name("file_seconds.json")
"""Seconds each test file took in the full tier (2 xdist workers, 1 thread each, a 2-core machine), as
recorded by ``LBT_RECORD_SECONDS=1 ./run_tests.sh --all``. Only the order of files depends on it."""


def longest_files_first(items: list) -> list:
    """The items grouped by file, the longest files first (each file's own order kept).

    ``./run_tests.sh --all`` hands whole files to two xdist workers in collection order
    (``--no-loadscope-reorder``; xdist's own order puts files with many short tests first and left the long
    launcher files to one worker at the end). Longest first keeps the two workers' ends close. A file not in
    ``file_seconds.json`` is estimated from its tests (30 s a slow one, 0.2 s any other).
    """
    recorded = json.loads(FILE_SECONDS.read_text()) if FILE_SECONDS.exists() else {}
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)

    def seconds(path: str) -> float:
        if path in recorded:
            return recorded[path]
        return sum(30.0 if item.get_closest_marker("slow") else 0.2 for item in by_file[path])

    order = sorted(by_file, key=seconds, reverse=True)  # stable: ties keep collection order
    return [item for path in order for item in by_file[path]]


_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report) -> None:
    """With ``LBT_RECORD_SECONDS`` set, add each phase's time (setup, call, teardown) to its file's total."""
    if os.environ.get("LBT_RECORD_SECONDS"):
        path = report.nodeid.split("::")[0]
        _seconds[path] = _seconds.get(path, 0.0) + report.duration


def pytest_sessionfinish(session) -> None:
    """With ``LBT_RECORD_SECONDS`` set, write the files' seconds (on the controller when under xdist)."""
    if _seconds and not os.environ.get("PYTEST_XDIST_WORKER"):
        ordered = dict(sorted(((p, round(s, 1)) for p, s in _seconds.items()), key=lambda x: -x[1]))
        FILE_SECONDS.write_text(json.dumps(ordered, indent=1) + "\n")
