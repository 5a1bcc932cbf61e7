"""Diagnostics to log next to the loss: preference rewards and accuracies, clip fractions,
KL, ratio, entropy and advantage statistics.

Each is a pure function of the same arrays the losses take, returning float scalars (or `[B]`
per-pair values) that are never part of the gradient you optimise: wrap them in
`jax.lax.stop_gradient` or compute them outside the differentiated function. Statistics of an
empty batch are 0, not NaN.
"""

from tunelib.metrics._advantages import (
    AdvantageStatistics,
    advantage_statistics,
    zero_std_fraction,
)
from tunelib.metrics._entropy import EntropyStatistics, entropy_statistics
from tunelib.metrics._policy import (
    ApproxKL,
    ClipFractions,
    RatioStatistics,
    approx_kl,
    clip_fractions,
    ratio_statistics,
)
from tunelib.metrics._preference import implicit_rewards, preference_accuracy, reward_margins

__all__ = [
    "AdvantageStatistics",
    "ApproxKL",
    "ClipFractions",
    "EntropyStatistics",
    "RatioStatistics",
    "advantage_statistics",
    "approx_kl",
    "clip_fractions",
    "entropy_statistics",
    "implicit_rewards",
    "preference_accuracy",
    "ratio_statistics",
    "reward_margins",
    "zero_std_fraction",
]
