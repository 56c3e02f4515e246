"""Statistics of quantization: amax, scales, underflow / saturation, SQNR, exponent histograms, first NaN.

Pure functions of tensors: no torch.distributed inside (titan/runtime/numerics.py reduces across ranks). See
docs/numerics.md.
"""

from .nonfinite import FirstNonFinite, NonFinite
from .stats import (
    FIELDS,
    HIST_HI,
    HIST_LO,
    N_BINS,
    SIZE,
    combine,
    exponent_histogram,
    identity,
    operand_stats,
    reduce_ops,
    sqnr_db,
    summarize,
)

__all__ = [
    "FIELDS",
    "HIST_HI",
    "HIST_LO",
    "N_BINS",
    "SIZE",
    "FirstNonFinite",
    "NonFinite",
    "combine",
    "exponent_histogram",
    "identity",
    "operand_stats",
    "reduce_ops",
    "sqnr_db",
    "summarize",
]
