"""Losses for post-training, each a pure function returning unreduced values.

Data arrays come first, then keyword-only hyperparameters, then `where` (True = counts). Reduce
per-token values with `aggregate`, which returns a numerator and a denominator so that gradient
accumulation and data parallelism give exactly the full-batch result.
"""

from tunelib.losses._aggregation import AGGREGATION_MODES, Aggregate, aggregate
from tunelib.losses._sft import nll_loss

__all__ = [
    "AGGREGATION_MODES",
    "Aggregate",
    "aggregate",
    "nll_loss",
]
