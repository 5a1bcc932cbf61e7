"""Statistics of advantages and rewards that an RL run logs."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Real

from tunelib import _validation as v
from tunelib import advantages as advantages_lib
from tunelib._typing import Mask
from tunelib.metrics._summary import masked_extremes, masked_mean


class AdvantageStatistics(NamedTuple):
    """Summary of the valid entries of an advantage array; all fields are float scalars.

    Attributes:
      mean: the mean.
      std: the population standard deviation (ddof 0).
      min: the smallest valid entry.
      max: the largest valid entry.
      count: the number of valid entries.
    """

    mean: jax.Array
    std: jax.Array
    min: jax.Array
    max: jax.Array
    count: jax.Array


def advantage_statistics(
    advantages: Float[ArrayLike, "*B"], *, where: Mask[ArrayLike, "*B"] | None = None
) -> AdvantageStatistics:
    r"""Mean, standard deviation, minimum and maximum of the valid advantages.

    $$
    \mu = \frac{1}{n}\sum_{i : m_i} A_i, \qquad
    \sigma = \sqrt{\frac{1}{n}\sum_{i : m_i} (A_i - \mu)^2}
    $$

    with $A$ = `advantages`, $m$ = `where` and $n$ the number of valid entries; min and max
    run over the same entries. For `[B, T]` per-token advantages pass the completion mask, so
    that padding is not counted; for `[B]` per-sequence ones a row mask. With no valid entry
    every field is 0.

    Formerly `tunelib.advantages.advantage_statistics`, still served there until tunelib
    0.3.0, with a `DeprecationWarning`.

    Args:
      advantages: `[...]` advantages, any shape.
      where: `[...]` mask, True (or 1) = counts; all entries count when None. Masked entries
        are ignored, even when NaN or infinite.

    Returns:
      An `AdvantageStatistics(mean, std, min, max, count)` of float32 scalars (float64 for
      float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import advantage_statistics
      >>> a = jnp.array([[1.0, -1.0, jnp.nan], [2.0, 0.0, 0.0]])
      >>> where = jnp.array([[True, True, False], [True, True, False]])
      >>> stats = advantage_statistics(a, where=where)
      >>> print(stats.mean, stats.std.round(4), stats.min, stats.max, stats.count)
      0.5 1.118 -1.0 2.0 4.0
    """
    advantages = v.float_array(advantages, "advantages")
    where = v.mask_array(where, advantages.shape)
    x = jnp.where(where, advantages.astype(v.compute_dtype(advantages.dtype)), 0.0)
    mean = masked_mean(x, where)
    variance = masked_mean((x - mean) ** 2, where)
    low, high = masked_extremes(x, where)
    count = jnp.sum(where).astype(x.dtype)
    return AdvantageStatistics(mean=mean, std=jnp.sqrt(variance), min=low, max=high, count=count)


def zero_std_fraction(
    rewards: Real[ArrayLike, "*B G"], *, where: Mask[ArrayLike, "*B G"] | None = None
) -> Float[Array, ""]:
    r"""Fraction of groups whose valid rewards are all equal (zero spread).

    $$
    \frac{|\{\, g : \text{all valid } r_{g,i} \text{ equal} \,\}|}
         {|\{\, g : \text{group } g \text{ has a valid reward} \,\}|}
    $$

    over the groups on the last axis of $r$ = `rewards`. Such groups have zero
    group-relative advantage and contribute no policy gradient; a fraction near 1 means the
    prompts are too easy or too hard for the policy (the complement of what
    `dynamic_sampling_mask` keeps, among groups with a valid reward). TRL logs the same
    quantity as `frac_reward_zero_std`, testing the std against 0 with a tolerance; this test
    is exact. Groups without any valid reward are left out; if none has one, the result is 0.

    Formerly `tunelib.advantages.zero_std_fraction`, still served there until tunelib 0.3.0, with a
    `DeprecationWarning`.

    Args:
      rewards: `[..., G]` rewards, integer or float; NaN or infinite rewards are ignored.
      where: `[..., G]` mask, True (or 1) = counts.

    Returns:
      A float32 scalar in $[0, 1]$ (float64 for float64 rewards).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import zero_std_fraction
      >>> rewards = jnp.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [jnp.nan, jnp.nan]])
      >>> print(zero_std_fraction(rewards).round(4))
      0.6667
    """
    kept = advantages_lib.dynamic_sampling_mask(rewards, where=where)
    rewards = jnp.asarray(rewards)
    valid = v.mask_array(where, rewards.shape) & jnp.isfinite(rewards)
    scored = jnp.any(valid, axis=-1)
    flat = (scored & ~kept).astype(v.compute_dtype(rewards.dtype))
    return masked_mean(flat, scored)
