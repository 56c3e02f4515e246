"""Optimizers whose states and master weights live in any format of the numerics core (docs/optimizers.md)."""

from .adamw import LowBitAdamW, moment_bound
from .codec import StateCodec
from .options import AdamWOptions, SGDOptions
from .presets import PRESETS, parse_state_format
from .sgd import LowBitSGD

OPTIMIZERS = {"LowBitAdamW": LowBitAdamW, "LowBitSGD": LowBitSGD}
"""Our optimizers by the name used in ``optimizer_name``."""

__all__ = [
    "OPTIMIZERS",
    "PRESETS",
    "AdamWOptions",
    "LowBitAdamW",
    "LowBitSGD",
    "SGDOptions",
    "StateCodec",
    "moment_bound",
    "parse_state_format",
]
