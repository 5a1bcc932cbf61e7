"""Advantage estimators, returns, whitening, reward shaping, data filters and controllers for RL.

Group-relative estimators take the rewards of the G completions of each prompt on the last
axis, `rewards [..., G]`, or flat, `rewards [B*G]` with `group_size=G` (never guessed), and
return one advantage per completion in the layout they were given. Per-token estimators take
`[B, T]` arrays and an optional completion mask `where` (True = counts; None = every token),
and skip masked tokens. Masks may be boolean or integer 0/1. Rewards that are NaN (unscorable)
and masked entries get exactly 0; integer rewards are cast to float, never truncated;
statistics run in float32 (float64 for float64 input).
"""

from tunelib._deprecation import moved_names
from tunelib.advantages._controllers import (
    Controller,
    EntropyControllerState,
    KLControllerState,
    ReferencePointState,
    RewardNormalizer,
    RunningMomentsState,
    adaptive_entropy_controller,
    adaptive_kl_controller,
    fixed_kl_controller,
    reward_normalizer,
    running_kto_reference_point,
)
from tunelib.advantages._entropy_mask import high_entropy_mask
from tunelib.advantages._gae import discounted_returns, gae, lambda_returns
from tunelib.advantages._group import (
    COMBINES,
    SCALES,
    group_advantages,
    multi_reward_advantages,
    rloo_advantages,
)
from tunelib.advantages._kl_shaping import kl_reward_shaping
from tunelib.advantages._shaping import (
    dynamic_sampling_mask,
    overlong_penalty,
    sequence_rewards_to_tokens,
    truncation_mask,
)
from tunelib.advantages._whitening import whiten

# The statistics moved to `tunelib.metrics`; served from here until tunelib 0.3.0.
__getattr__ = moved_names(
    __name__,
    {
        name: ("tunelib.metrics", name)
        for name in ("AdvantageStatistics", "advantage_statistics", "zero_std_fraction")
    },
)

__all__ = [
    "COMBINES",
    "SCALES",
    "Controller",
    "EntropyControllerState",
    "KLControllerState",
    "ReferencePointState",
    "RewardNormalizer",
    "RunningMomentsState",
    "adaptive_entropy_controller",
    "adaptive_kl_controller",
    "discounted_returns",
    "dynamic_sampling_mask",
    "fixed_kl_controller",
    "gae",
    "group_advantages",
    "high_entropy_mask",
    "kl_reward_shaping",
    "lambda_returns",
    "multi_reward_advantages",
    "overlong_penalty",
    "reward_normalizer",
    "rloo_advantages",
    "running_kto_reference_point",
    "sequence_rewards_to_tokens",
    "truncation_mask",
    "whiten",
]
