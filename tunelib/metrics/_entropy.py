"""Entropy statistics of the policy: what RL runs log to watch for entropy collapse."""

from typing import NamedTuple

import jax
from jax.typing import ArrayLike
from jaxtyping import Float

from tunelib import _validation as v
from tunelib._typing import Mask
from tunelib.metrics._summary import masked_extremes, masked_mean


class EntropyStatistics(NamedTuple):
    """Mean, minimum and maximum of the entropy over the valid tokens (all 0 when none)."""

    mean: jax.Array
    min: jax.Array
    max: jax.Array


def entropy_statistics(
    entropy: Float[ArrayLike, "B T"], *, where: Mask[ArrayLike, "B T"] | None = None
) -> EntropyStatistics:
    r"""Mean, minimum and maximum of the per-token entropy over the valid tokens.

    $$
    \bar H = \frac{\sum_{i,t} m_{i,t} H_{i,t}}{\sum_{i,t} m_{i,t}}, \qquad
    \min_{m_{i,t}} H_{i,t}, \qquad \max_{m_{i,t}} H_{i,t}
    $$

    with $H$ = `entropy` and $m$ = `where`: the statistics RL trainers log to watch for
    entropy collapse. A fully masked batch gives 0 for all three (not NaN or $\pm\infty$).
    The mean weighs every valid token alike (the ``"token_mean"`` mode of `aggregate`, which
    gives the numerator and denominator for an exact mean over micro-batches).

    Formerly `tunelib.losses.entropy_statistics`, still served there until tunelib 0.3.0, with a
    `DeprecationWarning`.

    Args:
      entropy: `[B, T]` per-token entropies.
      where: `[B, T]` mask, True (or 1) = counts; masked entries are ignored, even when NaN.

    Returns:
      `EntropyStatistics(mean, min, max)` of float32 scalars (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import entropy_statistics
      >>> entropy = jnp.array([[0.5, 2.0, jnp.nan], [1.0, 0.25, 0.0]])
      >>> where = jnp.array([[True, True, False], [True, True, False]])
      >>> stats = entropy_statistics(entropy, where=where)
      >>> print(stats.mean, stats.min, stats.max)
      0.9375 0.25 2.0
    """
    (entropy,), where = v.masked_floats(where, ndim=2, entropy=entropy)
    low, high = masked_extremes(entropy, where)
    return EntropyStatistics(mean=masked_mean(entropy, where), min=low, max=high)
