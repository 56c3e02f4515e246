"""The upstream noise filter (titan/platform/noise.py) drops exactly its lines, made by the upstream code
itself, and lets every other record through: other lines of the same loggers, lines of other loggers, and its
own lines before it is installed."""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterator

import pytest
import torch.utils._pytree as pytree

from low_bits_training.titan.platform import noise


class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def heard() -> Iterator[dict[str, _Keep]]:
    """A handler on each logger of ``NOISE`` (records that pass its filters), filters restored after."""
    loggers = {n.logger: logging.getLogger(n.logger or None) for n in noise.NOISE}
    saved = {name: (list(lg.filters), lg.level, lg.propagate) for name, lg in loggers.items()}
    handlers = {name: _Keep() for name in loggers}
    for name, lg in loggers.items():
        lg.filters = [f for f in lg.filters if not isinstance(f, noise.UpstreamNoise)]
        lg.setLevel(logging.DEBUG)
        lg.propagate = False
        lg.addHandler(handlers[name])
    yield handlers
    for name, lg in loggers.items():
        lg.removeHandler(handlers[name])
        lg.filters, level, lg.propagate = saved[name][0], saved[name][1], saved[name][2]
        lg.setLevel(level)


def _upstream_lines() -> None:
    """Make each upstream line the way upstream makes it: an Enum registered with torch's pytree (what torchao
    does at import), and torchtitan's checkpoint config without an initial_load_path."""
    from torchtitan.components.checkpoint import CheckpointManager

    class Kernel(enum.StrEnum):  # a fresh enum: register_constant refuses one registered before
        A = "a"

    pytree.register_constant(Kernel)
    CheckpointManager.Config()


def _other_lines() -> None:
    logging.getLogger("torch.utils._pytree").warning("a pytree warning that is not the Enum one")
    logging.getLogger().warning(
        "initial_load_model_only=True has no effect without an initial_load_path. Or has it?"
    )
    logging.getLogger().warning("checkpoint.load_only is True; enable_first_step_checkpoint will be ignored.")
    logging.getLogger("torch.utils._pytree").error("register_constant() failed")


def test_without_the_filter_upstream_says_both_lines(heard):
    _upstream_lines()
    pytree_lines, root_lines = heard["torch.utils._pytree"].messages, heard[""].messages
    assert len(pytree_lines) == 1 and "Enum subclass" in pytree_lines[0]
    assert root_lines == ["initial_load_model_only=True has no effect without an initial_load_path."]


def test_the_filter_drops_exactly_those_lines(heard):
    noise.install()
    noise.install()  # twice: still one filter per logger
    for name in heard:
        filters = logging.getLogger(name or None).filters
        assert sum(isinstance(f, noise.UpstreamNoise) for f in filters) == 1
    _upstream_lines()
    assert [h.messages for h in heard.values()] == [[], []]
    _other_lines()
    assert heard["torch.utils._pytree"].messages == [
        "a pytree warning that is not the Enum one",
        "register_constant() failed",
    ]
    assert heard[""].messages == [
        "initial_load_model_only=True has no effect without an initial_load_path. Or has it?",
        "checkpoint.load_only is True; enable_first_step_checkpoint will be ignored.",
    ]


def test_every_entry_says_why():
    assert all(n.why and n.words for n in noise.NOISE)
