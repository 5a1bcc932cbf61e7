"""Diagnostics of a policy update: clip fractions, approximate KL, ratio statistics.

Each is a pure function returning float scalars averaged over the valid tokens (0 for a batch
without one), to log next to the loss; none is part of the loss. `clip_masks` gives the
per-token indicators behind the clip fractions, for a reduction of one's own.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Float

from tunelib import _validation as v
from tunelib import logprobs, losses
from tunelib._numerics import exp_minus_one_minus
from tunelib._typing import Mask, Scalar
from tunelib.metrics._summary import masked_extremes, masked_mean


class ClipFractions(NamedTuple):
    """Fractions of the valid tokens whose ratio the clipped surrogate cut off.

    Attributes:
      low: clipped at the low side where it matters: $A_t < 0$ and
        $r_t < 1 - \\varepsilon_{\\mathrm{low}}$ (the token gets no gradient). TRL's
        `clip_ratio/low_mean`.
      high: clipped at the high side where it matters: $A_t > 0$ and
        $r_t > 1 + \\varepsilon_{\\mathrm{high}}$ (no gradient). TRL's `clip_ratio/high_mean`.
      region: ratio outside $[1 - \\varepsilon_{\\mathrm{low}}, 1 + \\varepsilon_{\\mathrm{high}}]$
        whatever the advantage (the "clipfrac" most PPO implementations log).
      clipped: clipped on either side where it matters, the tokens of `low` and `high`
        together: TRL's `clip_ratio/region_mean` and Tunix's `pg_clipfrac` (which is not
        `region`: a token outside the region whose advantage pushes it back in is not
        clipped here).
      dual: $A_t < 0$ and $r_t > c$: the tokens where the dual clip bounds the loss (Tunix's
        `pg_clipfrac_lower`, as a token mean); 0 without `dual_clip`.
      low_min: the smallest per-row `low` fraction, over the rows with a valid token (TRL's
        `clip_ratio/low_min`).
      high_max: the largest per-row `high` fraction, over the rows with a valid token (TRL's
        `clip_ratio/high_max`).
    """

    low: jax.Array
    high: jax.Array
    region: jax.Array
    clipped: jax.Array
    dual: jax.Array
    low_min: jax.Array
    high_max: jax.Array


class ClipMasks(NamedTuple):
    """Per-token indicators of the clipped surrogate, `[B, T]` booleans, False where masked.

    Attributes:
      low: $A_t < 0$ and $r_t < 1 - \\varepsilon_{\\mathrm{low}}$.
      high: $A_t > 0$ and $r_t > 1 + \\varepsilon_{\\mathrm{high}}$.
      region: $r_t \\notin [1 - \\varepsilon_{\\mathrm{low}}, 1 + \\varepsilon_{\\mathrm{high}}]$.
      dual: $A_t < 0$ and $r_t > c$ (all False without `dual_clip`).
    """

    low: jax.Array
    high: jax.Array
    region: jax.Array
    dual: jax.Array


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
    """Mean, minimum and maximum of the importance ratio over the valid tokens, and the mean
    of the absolute log-ratio, $|\\log r_t|$ (Tunix's `log_ratio/abs_mean`)."""

    mean: jax.Array
    min: jax.Array
    max: jax.Array
    abs_log_mean: jax.Array


def _clip_masks(
    token_logps: ArrayLike,
    old_token_logps: ArrayLike,
    advantages: ArrayLike,
    *,
    level: str,
    epsilon_low: Scalar,
    epsilon_high: Scalar,
    dual_clip: Scalar | None,
    log_ratio_clamp: Scalar,
    where: ArrayLike | None,
) -> tuple[ClipMasks, jax.Array, jnp.dtype]:
    """The clip indicators, the checked mask and the compute dtype."""
    v.non_negative(epsilon_low, "epsilon_low")
    v.non_negative(epsilon_high, "epsilon_high")
    if dual_clip is not None:
        v.greater_than_one(dual_clip, "dual_clip")
    ratio = losses.importance_ratio(
        token_logps, old_token_logps, level=level, log_ratio_clamp=log_ratio_clamp, where=where
    )
    where = v.mask_array(where, ratio.shape)
    adv = v.advantages_array(advantages, where, ratio.dtype)
    dtype = adv.dtype
    ratio = ratio.astype(dtype)
    below = ratio < 1 - jnp.asarray(epsilon_low, dtype)
    above = ratio > 1 + jnp.asarray(epsilon_high, dtype)
    if dual_clip is None:
        dual = jnp.zeros_like(where)
    else:
        dual = (adv < 0) & (ratio > jnp.asarray(dual_clip, dtype))
    masks = ClipMasks(
        low=below & (adv < 0) & where,
        high=above & (adv > 0) & where,
        region=(below | above) & where,
        dual=dual & where,
    )
    return masks, where, dtype


def clip_masks(
    token_logps: Float[ArrayLike, "B T"],
    old_token_logps: Float[ArrayLike, "B T"],
    advantages: Float[ArrayLike, " B"] | Float[ArrayLike, "B T"],
    *,
    level: str = "token",
    epsilon_low: Scalar = 0.2,
    epsilon_high: Scalar = 0.2,
    dual_clip: Scalar | None = None,
    log_ratio_clamp: Scalar = 20.0,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> ClipMasks:
    r"""Per-token indicators of where the PPO surrogate clips, to reduce as one chooses.

    $$
    \mathrm{low}_t = [A_t < 0,\ r_t < 1 - \varepsilon_l], \quad
    \mathrm{high}_t = [A_t > 0,\ r_t > 1 + \varepsilon_h], \quad
    \mathrm{region}_t = [r_t \notin [1 - \varepsilon_l, 1 + \varepsilon_h]], \quad
    \mathrm{dual}_t = [A_t < 0,\ r_t > c]
    $$

    with $r_t$ the importance ratio of `token_logps` over `old_token_logps` at `level` (see
    `importance_ratio`), $A_t$ = `advantages`, $\varepsilon_l$ = `epsilon_low`,
    $\varepsilon_h$ = `epsilon_high` and $c$ = `dual_clip`; all False on masked tokens.
    `clip_fractions` averages them over tokens; these masks let a run reduce them as its loss
    is reduced, with `tunelib.losses.aggregate`. The masks are boolean and `aggregate` (like
    `sequence_mean`) takes floating-point values: convert them with `.astype(float)` first.

    * Tunix logs `pg_clipfrac_lower` (GRPO) aggregated with the loss's own mode, by default
      per sequence: ``aggregate(masks.dual.astype(float), mode="seq_mean_token_mean",
      where=where).mean()``.
    * At the sequence level (``level="sequence"``, GSPO) TRL averages its clip indicators
      over sequences, each row once, empty rows included as unclipped:
      ``aggregate(masks.low.astype(float), mode="seq_mean_token_mean", empty_rows="count",
      where=where).mean()``.
    * Each row's own fraction is
      ``tunelib.logprobs.sequence_mean(masks.low.astype(float), where=where)``.

    The dual-clip bound $-c A_t$ binds, for $A_t < 0$, exactly where $r_t > c$ (with
    $c > 1$ the clipped ratio never exceeds the ratio there), so `dual` is where
    `policy_gradient_loss` with the same `dual_clip` replaces the loss by the bound.

    Args:
      token_logps: `[B, T]` current-policy log-probs.
      old_token_logps: `[B, T]` behaviour-policy log-probs.
      advantages: `[B]` or `[B, T]`.
      level: ``"token"``, ``"sequence"`` or ``"sequence_token"`` (static).
      epsilon_low: $\varepsilon_l \ge 0$; may be traced.
      epsilon_high: $\varepsilon_h \ge 0$; may be traced.
      dual_clip: $c > 1$, or None (then `dual` is all False); may be traced.
      log_ratio_clamp: bound on the log-ratio before `exp`; may be traced.
      where: `[B, T]` mask, True (or 1) = counts; NaN or infinite values under it are ignored.

    Returns:
      A `ClipMasks(low, high, region, dual)` of `[B, T]` boolean arrays.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import clip_masks
      >>> logps = jnp.log(jnp.array([[0.5, 0.9, 0.2, 0.9]]))
      >>> old = jnp.log(jnp.array([[0.5, 0.5, 0.5, 0.5]]))  # ratios 1, 1.8, 0.4, 1.8
      >>> masks = clip_masks(logps, old, jnp.array([[1.0, 1.0, -1.0, -1.0]]), dual_clip=1.5)
      >>> print(masks.high.astype(int), masks.low.astype(int), masks.dual.astype(int))
      [[0 1 0 0]] [[0 0 1 0]] [[0 0 0 1]]
      >>> from tunelib.losses import aggregate
      >>> low = masks.low.astype(float)  # aggregate takes floating-point values
      >>> print(aggregate(low, mode="seq_mean_token_mean", empty_rows="count").mean())
      0.25

    References:
      Schulman et al., "Proximal Policy Optimization Algorithms", 2017,
      https://arxiv.org/abs/1707.06347.
      Ye et al., "Mastering Complex Control in MOBA Games with Deep Reinforcement Learning"
      (dual clip), 2020, https://arxiv.org/abs/1912.09729.
    """
    masks, _, _ = _clip_masks(
        token_logps,
        old_token_logps,
        advantages,
        level=level,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        dual_clip=dual_clip,
        log_ratio_clamp=log_ratio_clamp,
        where=where,
    )
    return masks


def clip_fractions(
    token_logps: Float[ArrayLike, "B T"],
    old_token_logps: Float[ArrayLike, "B T"],
    advantages: Float[ArrayLike, " B"] | Float[ArrayLike, "B T"],
    *,
    level: str = "token",
    epsilon_low: Scalar = 0.2,
    epsilon_high: Scalar = 0.2,
    dual_clip: Scalar | None = None,
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
    arguments as to `policy_gradient_loss`: then $f_{\mathrm{low}} + f_{\mathrm{high}}$
    (`clipped`) is exactly the fraction of tokens the loss gave no gradient (without
    `dual_clip` / `ratio_cap`). GSPO reports these fractions at the sequence level
    (``level="sequence"``), where they are about two orders of magnitude larger than GRPO's
    token-level ones.

    What TRL and Tunix log, and how it differs from the fields here:

    * `clipped` = $f_{\mathrm{low}} + f_{\mathrm{high}}$ is TRL's `clip_ratio/region_mean`
      and Tunix's `pg_clipfrac`; `region` ($r_t$ outside the interval, whatever $A_t$) is
      the older PPO statistic and is at least as large.
    * `low_min` and `high_max` are TRL's `clip_ratio/low_min` and `clip_ratio/high_max`: the
      smallest per-row low fraction and the largest per-row high fraction, $f^{(i)} =
      \frac{1}{|o_i|}\sum_t \mathbb{1}[\cdot]$ over the rows $i$ with a valid token (TRL's
      NaN for an empty row is skipped by its `nanmin` / `nanmax` at the token level).
    * `dual` = $\frac{1}{N}\sum_t \mathbb{1}[A_t < 0,\ r_t > c]$, $c$ = `dual_clip`, is
      Tunix's `pg_clipfrac_lower` as a token mean; Tunix's GRPO reduces it with the loss's
      aggregation mode instead (per sequence by default): reduce
      `clip_masks(...).dual.astype(float)` with `aggregate` for that.
    * The means here weigh every valid token alike at every `level`. At the sequence level
      TRL weighs each row once (empty rows too): reduce `clip_masks(...).low.astype(float)`
      with ``aggregate(..., mode="seq_mean_token_mean", empty_rows="count").mean()`` for its
      value.

    Formerly `tunelib.losses.clip_fractions`, still served there until tunelib 0.3.0, with a
    `DeprecationWarning`.

    Args:
      token_logps: `[B, T]` current-policy log-probs.
      old_token_logps: `[B, T]` behaviour-policy log-probs.
      advantages: `[B]` or `[B, T]`.
      level: ``"token"``, ``"sequence"`` or ``"sequence_token"`` (static).
      epsilon_low: $\varepsilon_l \ge 0$; may be traced.
      epsilon_high: $\varepsilon_h \ge 0$; may be traced.
      dual_clip: $c > 1$ for `dual`, or None (then `dual` is 0); may be traced.
      log_ratio_clamp: bound on the log-ratio before `exp`; may be traced.
      where: `[B, T]` mask, True (or 1) = counts; NaN or infinite values under it are ignored.

    Returns:
      A `ClipFractions` of float32 scalars in $[0, 1]$ (float64 for float64 input); all 0
      when no token is valid.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import clip_fractions
      >>> logps = jnp.log(jnp.array([[0.5, 0.9, 0.2, 0.9], [0.5, 0.5, 0.5, 0.9]]))
      >>> old = jnp.log(jnp.full((2, 4), 0.5))  # ratios 1, 1.8, 0.4, 1.8 and 1, 1, 1, 1.8
      >>> advantages = jnp.array([[1.0, 1.0, -1.0, -1.0], [1.0, 1.0, 1.0, 1.0]])
      >>> out = clip_fractions(logps, old, advantages, dual_clip=1.5)
      >>> print(out.low, out.high, out.region, out.clipped, out.dual)
      0.125 0.25 0.5 0.375 0.125
      >>> print(out.low_min, out.high_max)  # per row: low 0.25 and 0, high 0.25 and 0.25
      0.0 0.25

    References:
      Schulman et al., "Proximal Policy Optimization Algorithms", 2017,
      https://arxiv.org/abs/1707.06347.
      Zheng et al., "Group Sequence Policy Optimization", 2025,
      https://arxiv.org/abs/2507.18071.
    """
    masks, where, dtype = _clip_masks(
        token_logps,
        old_token_logps,
        advantages,
        level=level,
        epsilon_low=epsilon_low,
        epsilon_high=epsilon_high,
        dual_clip=dual_clip,
        log_ratio_clamp=log_ratio_clamp,
        where=where,
    )
    low, high = masks.low.astype(dtype), masks.high.astype(dtype)
    rows = jnp.any(where, axis=-1)
    low_min, _ = masked_extremes(logprobs.sequence_mean(low, where=where), rows)
    _, high_max = masked_extremes(logprobs.sequence_mean(high, where=where), rows)
    return ClipFractions(
        low=masked_mean(low, where),
        high=masked_mean(high, where),
        region=masked_mean(masks.region.astype(dtype), where),
        clipped=masked_mean((masks.low | masks.high).astype(dtype), where),
        dual=masked_mean(masks.dual.astype(dtype), where),
        low_min=low_min,
        high_max=high_max,
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
        k3=masked_mean(exp_minus_one_minus(clamped), where),
    )


def ratio_statistics(
    token_logps: Float[ArrayLike, "B T"],
    old_token_logps: Float[ArrayLike, "B T"],
    *,
    level: str = "token",
    log_ratio_clamp: Scalar = 20.0,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> RatioStatistics:
    r"""Mean, minimum and maximum of the importance ratio, and its mean absolute log.

    $$
    \bar r = \frac{1}{N} \sum_t r_t, \qquad \min_t r_t, \qquad \max_t r_t, \qquad
    \overline{|\log r|} = \frac{1}{N} \sum_t |\log r_t|
    $$

    over the $N$ valid tokens, with $r_t$ the ratio of `token_logps` over `old_token_logps` at
    `level` (see `importance_ratio`, whose clamp applies: $|\log r_t| \le$
    `log_ratio_clamp`). At the sequence levels each sequence's ratio counts once per valid
    token, so the means weigh sequences by length. The mean absolute log-ratio is Tunix's
    `log_ratio/abs_mean` (which clamps the log-ratio to $\pm 20$ too, the default here); it
    measures how far the policy moved whatever the direction, where $\bar r$ lets moves up
    and down cancel. Tunix's `is_ratio/min` of a batch without a valid token is $+\infty$;
    here every field is 0 then.

    Formerly `tunelib.losses.ratio_statistics`, still served there until tunelib 0.3.0, with a
    `DeprecationWarning`.

    Args:
      token_logps: `[B, T]` current-policy log-probs.
      old_token_logps: `[B, T]` behaviour-policy log-probs.
      level: ``"token"``, ``"sequence"`` or ``"sequence_token"`` (static).
      log_ratio_clamp: bound on the log-ratio before `exp`; may be traced.
      where: `[B, T]` mask, True (or 1) = counts; NaN or infinite values under it are ignored.

    Returns:
      A `RatioStatistics(mean, min, max, abs_log_mean)` of float32 scalars (float64 for
      float64 input); all 0 when no token is valid.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import ratio_statistics
      >>> logps = jnp.log(jnp.array([[0.5, 0.9, 0.2]]))
      >>> old = jnp.log(jnp.array([[0.5, 0.5, 0.5]]))
      >>> print([round(float(x), 4) for x in ratio_statistics(logps, old)])
      [1.0667, 0.4, 1.8, 0.5013]

    References:
      Schulman et al., "Proximal Policy Optimization Algorithms", 2017,
      https://arxiv.org/abs/1707.06347.
    """
    ratio = losses.importance_ratio(
        token_logps, old_token_logps, level=level, log_ratio_clamp=log_ratio_clamp, where=where
    )
    (logps, old), where = v.masked_floats(
        where, ndim=2, token_logps=token_logps, old_token_logps=old_token_logps
    )
    # The log of the ratio at `level`, computed directly (log(exp(x)) loses small x).
    clamp = jnp.asarray(log_ratio_clamp, logps.dtype)
    log_ratio = logps - old
    if level != "token":
        log_ratio = jnp.broadcast_to(
            logprobs.sequence_mean(log_ratio, where=where)[:, None], log_ratio.shape
        )
    log_ratio = jnp.clip(log_ratio, -clamp, clamp).astype(ratio.dtype)
    low, high = masked_extremes(ratio, where)
    return RatioStatistics(
        mean=masked_mean(ratio, where),
        min=low,
        max=high,
        abs_log_mean=masked_mean(jnp.abs(log_ratio), where),
    )
