"""Diagnostics of a policy update: clip fractions, approximate KL, ratio statistics.

Each is a pure function returning float scalars averaged over the valid tokens (0 for a batch
without one), to log next to the loss; none is part of the loss.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Float

from tunelib import _validation as v
from tunelib import losses
from tunelib._typing import Mask, Scalar
from tunelib.metrics._summary import masked_extremes, masked_mean


class ClipFractions(NamedTuple):
    """Fractions of the valid tokens whose ratio the clipped surrogate cut off.

    Attributes:
      low: clipped at the low side where it matters: $A_t < 0$ and
        $r_t < 1 - \\varepsilon_{\\mathrm{low}}$ (the token gets no gradient).
      high: clipped at the high side where it matters: $A_t > 0$ and
        $r_t > 1 + \\varepsilon_{\\mathrm{high}}$ (no gradient).
      region: ratio outside $[1 - \\varepsilon_{\\mathrm{low}}, 1 + \\varepsilon_{\\mathrm{high}}]$
        whatever the advantage (the "clipfrac" most PPO implementations log).
    """

    low: jax.Array
    high: jax.Array
    region: jax.Array


class ApproxKL(NamedTuple):
    """Sample estimates of $\\mathrm{KL}(\\pi_{\\mathrm{old}} \\| \\pi_\\theta)$, token means.

    Attributes:
      k1: mean of $-\\log r_t$: unbiased, high variance, can be negative.
      k2: mean of $\\frac12 (\\log r_t)^2$: biased, low variance, $\\ge 0$.
      k3: mean of $(r_t - 1) - \\log r_t$: unbiased, low variance, $\\ge 0$.
    """

    k1: jax.Array
    k2: jax.Array
    k3: jax.Array


class RatioStatistics(NamedTuple):
    """Mean, minimum and maximum of the importance ratio over the valid tokens."""

    mean: jax.Array
    min: jax.Array
    max: jax.Array


def clip_fractions(
    token_logps: Float[ArrayLike, "B T"],
    old_token_logps: Float[ArrayLike, "B T"],
    advantages: Float[ArrayLike, " B"] | Float[ArrayLike, "B T"],
    *,
    level: str = "token",
    epsilon_low: Scalar = 0.2,
    epsilon_high: Scalar = 0.2,
    log_ratio_clamp: Scalar = 20.0,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> ClipFractions:
    r"""Fractions of valid tokens clipped by the PPO surrogate, by side and overall.

    $$
    f_{\mathrm{low}} = \frac{1}{N} \sum_t \mathbb{1}[A_t < 0,\ r_t < 1 - \varepsilon_l],
    \quad
    f_{\mathrm{high}} = \frac{1}{N} \sum_t \mathbb{1}[A_t > 0,\ r_t > 1 + \varepsilon_h],
    \quad
    f_{\mathrm{region}} = \frac{1}{N} \sum_t \mathbb{1}[r_t \notin [1 - \varepsilon_l,
    1 + \varepsilon_h]]
    $$

    over the $N$ valid tokens, with $r_t$ the importance ratio of `token_logps` over
    `old_token_logps` at `level` (see `importance_ratio`), $A_t$ = `advantages`,
    $\varepsilon_l$ = `epsilon_low` and $\varepsilon_h$ = `epsilon_high`. Pass the same
    arguments as to `policy_gradient_loss`: then $f_{\mathrm{low}} + f_{\mathrm{high}}$ is
    exactly the fraction of tokens the loss gave no gradient (without `dual_clip` /
    `ratio_cap`). GSPO reports these fractions at the sequence level (``level="sequence"``),
    where they are about two orders of magnitude larger than GRPO's token-level ones.

    Formerly `tunelib.losses.clip_fractions`, still served there until tunelib 0.3.0, with a
    `DeprecationWarning`.

    Args:
      token_logps: `[B, T]` current-policy log-probs.
      old_token_logps: `[B, T]` behaviour-policy log-probs.
      advantages: `[B]` or `[B, T]`.
      level: ``"token"``, ``"sequence"`` or ``"sequence_token"`` (static).
      epsilon_low: $\varepsilon_l \ge 0$; may be traced.
      epsilon_high: $\varepsilon_h \ge 0$; may be traced.
      log_ratio_clamp: bound on the log-ratio before `exp`; may be traced.
      where: `[B, T]` mask, True (or 1) = counts; NaN or infinite values under it are ignored.

    Returns:
      A `ClipFractions` of float32 scalars in $[0, 1]$ (float64 for float64 input); all 0
      when no token is valid.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import clip_fractions
      >>> logps = jnp.log(jnp.array([[0.5, 0.9, 0.2, 0.9]]))
      >>> old = jnp.log(jnp.array([[0.5, 0.5, 0.5, 0.5]]))  # ratios 1, 1.8, 0.4, 1.8
      >>> out = clip_fractions(logps, old, jnp.array([[1.0, 1.0, -1.0, -1.0]]))
      >>> print(out.low, out.high, out.region)
      0.25 0.25 0.75

    References:
      Schulman et al., "Proximal Policy Optimization Algorithms", 2017,
      https://arxiv.org/abs/1707.06347.
      Zheng et al., "Group Sequence Policy Optimization", 2025,
      https://arxiv.org/abs/2507.18071.
    """
    v.non_negative(epsilon_low, "epsilon_low")
    v.non_negative(epsilon_high, "epsilon_high")
    ratio = losses.importance_ratio(
        token_logps, old_token_logps, level=level, log_ratio_clamp=log_ratio_clamp, where=where
    )
    where = v.mask_array(where, ratio.shape)
    adv = v.advantages_array(advantages, where, ratio.dtype)
    dtype = adv.dtype
    ratio = ratio.astype(dtype)
    below = ratio < 1 - jnp.asarray(epsilon_low, dtype)
    above = ratio > 1 + jnp.asarray(epsilon_high, dtype)
    return ClipFractions(
        low=masked_mean((below & (adv < 0)).astype(dtype), where),
        high=masked_mean((above & (adv > 0)).astype(dtype), where),
        region=masked_mean((below | above).astype(dtype), where),
    )


def approx_kl(
    token_logps: Float[ArrayLike, "B T"],
    old_token_logps: Float[ArrayLike, "B T"],
    *,
    log_ratio_clamp: Scalar = 20.0,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> ApproxKL:
    r"""Approximate $\mathrm{KL}(\pi_{\mathrm{old}} \| \pi_\theta)$ from the sampled tokens.

    $$
    k_1 = \frac{1}{N} \sum_t -\log r_t, \qquad
    k_2 = \frac{1}{N} \sum_t \tfrac12 (\log r_t)^2, \qquad
    k_3 = \frac{1}{N} \sum_t \big((r_t - 1) - \log r_t\big), \qquad
    \log r_t = \log \pi_\theta(y_t) - \log \pi_{\mathrm{old}}(y_t)
    $$

    over the $N$ valid tokens, with $\log \pi_\theta$ = `token_logps` and
    $\log \pi_{\mathrm{old}}$ = `old_token_logps`. The tokens were sampled from
    $\pi_{\mathrm{old}}$, so these estimate the KL of the behaviour policy from the updated
    one, the statistic PPO implementations watch to stop an epoch early (Schulman's
    estimators). $k_3$ is unbiased and never negative, the usual choice (Stable-Baselines3's
    `approx_kl`); $k_1$ is the naive unbiased estimate (Spinning Up's `approx_kl`), which can be
    negative on a batch; $k_2$ is TRL's PPO `approxkl`. All three are returned. In $k_3$ the
    log-ratio is clamped to $\pm$`log_ratio_clamp` so that $r_t$ is finite (then $k_3 \ge 0$
    still holds); $k_1$ and $k_2$ use it unclamped.

    Formerly `tunelib.losses.approx_kl`, still served there until tunelib 0.3.0, with a
    `DeprecationWarning`.

    Args:
      token_logps: `[B, T]` log-probs under the updated policy.
      old_token_logps: `[B, T]` log-probs under the behaviour policy that sampled the tokens.
      log_ratio_clamp: bound on the log-ratio inside $k_3$; may be traced.
      where: `[B, T]` mask, True (or 1) = counts; NaN or infinite values under it are ignored.

    Returns:
      An `ApproxKL` of float32 scalars (float64 for float64 input); all 0 when no token is
      valid.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import approx_kl
      >>> logps = jnp.log(jnp.array([[0.5, 0.9]]))
      >>> old = jnp.log(jnp.array([[0.5, 0.5]]))
      >>> print([round(float(x), 4) for x in approx_kl(logps, old)])  # k1, k2, k3
      [-0.2939, 0.0864, 0.1061]

    References:
      Schulman, "Approximating KL Divergence", 2020, http://joschu.net/blog/kl-approx.html.
    """
    v.positive_scalar(log_ratio_clamp, "log_ratio_clamp")
    (logps, old), where = v.masked_floats(
        where, ndim=2, token_logps=token_logps, old_token_logps=old_token_logps
    )
    log_ratio = logps - old
    clamp = jnp.asarray(log_ratio_clamp, logps.dtype)
    clamped = jnp.clip(log_ratio, -clamp, clamp)
    return ApproxKL(
        k1=masked_mean(-log_ratio, where),
        k2=masked_mean(0.5 * log_ratio**2, where),
        k3=masked_mean(jnp.expm1(clamped) - clamped, where),
    )


def ratio_statistics(
    token_logps: Float[ArrayLike, "B T"],
    old_token_logps: Float[ArrayLike, "B T"],
    *,
    level: str = "token",
    log_ratio_clamp: Scalar = 20.0,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> RatioStatistics:
    r"""Mean, minimum and maximum of the importance ratio over the valid tokens.

    $$
    \bar r = \frac{1}{N} \sum_t r_t, \qquad \min_t r_t, \qquad \max_t r_t
    $$

    over the $N$ valid tokens, with $r_t$ the ratio of `token_logps` over `old_token_logps` at
    `level` (see `importance_ratio`, whose clamp applies). At the sequence levels each
    sequence's ratio counts once per valid token, so the mean weighs sequences by length.

    Formerly `tunelib.losses.ratio_statistics`, still served there until tunelib 0.3.0, with a
    `DeprecationWarning`.

    Args:
      token_logps: `[B, T]` current-policy log-probs.
      old_token_logps: `[B, T]` behaviour-policy log-probs.
      level: ``"token"``, ``"sequence"`` or ``"sequence_token"`` (static).
      log_ratio_clamp: bound on the log-ratio before `exp`; may be traced.
      where: `[B, T]` mask, True (or 1) = counts; NaN or infinite values under it are ignored.

    Returns:
      A `RatioStatistics` of float32 scalars (float64 for float64 input); all 0 when no token
      is valid.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import ratio_statistics
      >>> logps = jnp.log(jnp.array([[0.5, 0.9, 0.2]]))
      >>> old = jnp.log(jnp.array([[0.5, 0.5, 0.5]]))
      >>> print([round(float(x), 4) for x in ratio_statistics(logps, old)])  # mean, min, max
      [1.0667, 0.4, 1.8]

    References:
      Schulman et al., "Proximal Policy Optimization Algorithms", 2017,
      https://arxiv.org/abs/1707.06347.
    """
    ratio = losses.importance_ratio(
        token_logps, old_token_logps, level=level, log_ratio_clamp=log_ratio_clamp, where=where
    )
    where = v.mask_array(where, ratio.shape)
    low, high = masked_extremes(ratio, where)
    return RatioStatistics(mean=masked_mean(ratio, where), min=low, max=high)
