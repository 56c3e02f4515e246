"""Run folders -> pictures and one self-contained HTML page (``python -m low_bits_training.cli.report``)."""

from .build import build_report
from .runs import RunData, load_run

__all__ = ["RunData", "build_report", "load_run"]
