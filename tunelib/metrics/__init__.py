"""Diagnostics to log next to the loss: preference rewards and accuracies, clip fractions,
KL, ratio, entropy, advantage and reward statistics, the trainer-sampler mismatch; and the
evaluation of sampled completions: pass@k, maj@k and the diversity of a group.

Each is a pure function of the same arrays the losses take, returning float scalars (or `[B]`
per-pair values) that are never part of the gradient you optimise: wrap them in
`jax.lax.stop_gradient` or compute them outside the differentiated function. Statistics of an
empty batch are 0, not NaN.
"""

from tunelib.metrics._advantages import (
    AdvantageStatistics,
    RewardStatistics,
    advantage_statistics,
    multi_reward_zero_std_fraction,
    reward_statistics,
    zero_std_fraction,
)
from tunelib.metrics._diversity import distinct_completions, distinct_ngrams
from tunelib.metrics._entropy import EntropyStatistics, entropy_statistics
from tunelib.metrics._evaluation import majority_at_k, pass_at_k
from tunelib.metrics._mismatch import MismatchKL, effective_sample_size, mismatch_kl
from tunelib.metrics._policy import (
    ApproxKL,
    ClipFractions,
    ClipMasks,
    RatioStatistics,
    approx_kl,
    clip_fractions,
    clip_masks,
    ratio_statistics,
)
from tunelib.metrics._preference import implicit_rewards, preference_accuracy, reward_margins

__all__ = [
    "AdvantageStatistics",
    "ApproxKL",
    "ClipFractions",
    "ClipMasks",
    "EntropyStatistics",
    "MismatchKL",
    "RatioStatistics",
    "RewardStatistics",
    "advantage_statistics",
    "approx_kl",
    "clip_fractions",
    "clip_masks",
    "distinct_completions",
    "distinct_ngrams",
    "effective_sample_size",
    "entropy_statistics",
    "implicit_rewards",
    "majority_at_k",
    "mismatch_kl",
    "multi_reward_zero_std_fraction",
    "pass_at_k",
    "preference_accuracy",
    "ratio_statistics",
    "reward_margins",
    "reward_statistics",
    "zero_std_fraction",
]
