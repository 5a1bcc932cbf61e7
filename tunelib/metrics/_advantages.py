"""Statistics of advantages and rewards that an RL run logs."""

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Real

from tunelib import _validation as v
from tunelib import advantages as advantages_lib
from tunelib._typing import Mask, Scalar
from tunelib.metrics._summary import masked_extremes, masked_mean

Scale = Literal["group", "batch", "none"]
Combine = Literal["sum_then_normalize", "normalize_then_sum"]
Groups = Literal["scored", "all"]
GROUPS: tuple[str, ...] = Groups.__args__


class AdvantageStatistics(NamedTuple):
    """Summary of the valid entries of an advantage array; all fields are float scalars.

    Attributes:
      mean: the mean.
      std: the population standard deviation (ddof 0).
      min: the smallest valid entry.
      max: the largest valid entry.
      count: the number of valid entries.
      abs_mean: the mean of $|A|$ (Tunix's `advantage/abs_mean`).
      nonzero_fraction: the fraction of valid entries with $|A| >$ `atol` (Tunix's
        `advantage/nonzero_frac`).
    """

    mean: jax.Array
    std: jax.Array
    min: jax.Array
    max: jax.Array
    count: jax.Array
    abs_mean: jax.Array
    nonzero_fraction: jax.Array


class RewardStatistics(NamedTuple):
    """Summary of the scored rewards; all fields are float scalars.

    Attributes:
      mean: the mean.
      std: the standard deviation with `ddof` (0 with no more than `ddof` rewards).
      min: the smallest scored reward.
      max: the largest scored reward.
      count: the number of scored rewards.
    """

    mean: jax.Array
    std: jax.Array
    min: jax.Array
    max: jax.Array
    count: jax.Array


def advantage_statistics(
    advantages: Float[ArrayLike, "*B"],
    *,
    atol: Scalar = 0.0,
    where: Mask[ArrayLike, "*B"] | None = None,
) -> AdvantageStatistics:
    r"""Mean, spread, extremes, absolute mean and nonzero fraction of the valid advantages.

    $$
    \mu = \frac{1}{n}\sum_{i : m_i} A_i, \qquad
    \sigma = \sqrt{\frac{1}{n}\sum_{i : m_i} (A_i - \mu)^2}, \qquad
    \overline{|A|} = \frac{1}{n}\sum_{i : m_i} |A_i|, \qquad
    f_{\ne 0} = \frac{1}{n}\sum_{i : m_i} \mathbb{1}[|A_i| > \tau]
    $$

    with $A$ = `advantages`, $m$ = `where`, $\tau$ = `atol` and $n$ the number of valid
    entries; min and max run over the same entries. For `[B, T]` per-token advantages pass
    the completion mask, so that padding is not counted; for `[B]` per-sequence ones a row
    mask. With no valid entry every field is 0.

    The nonzero fraction is the share of completions that carry a learning signal (the
    complement of the zero-advantage groups of `zero_std_fraction`, when each completion
    counts once). tunelib's estimators give exactly 0 to groups without spread, so the
    default $\tau = 0$ is exact; Tunix's `advantage/nonzero_frac` uses $\tau = 10^{-8}$.
    Tunix computes its `advantage/*` statistics over tokens, each sequence's advantage
    counted once per valid token: to match it, pass the advantages broadcast to `[B, T]`
    with the completion mask; per sequence, pass `[B]`.

    Formerly `tunelib.advantages.advantage_statistics`, still served there until tunelib
    0.3.0, with a `DeprecationWarning`.

    Args:
      advantages: `[...]` advantages, any shape.
      atol: $\tau \ge 0$, the magnitude up to which an advantage counts as zero; may be
        traced.
      where: `[...]` mask, True (or 1) = counts; all entries count when None. Masked entries
        are ignored, even when NaN or infinite.

    Returns:
      An `AdvantageStatistics(mean, std, min, max, count, abs_mean, nonzero_fraction)` of
      float32 scalars (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import advantage_statistics
      >>> a = jnp.array([[1.0, -1.0, jnp.nan], [2.0, 0.0, 0.0]])
      >>> where = jnp.array([[True, True, False], [True, True, False]])
      >>> stats = advantage_statistics(a, where=where)
      >>> print(stats.mean, stats.std.round(4), stats.min, stats.max, stats.count)
      0.5 1.118 -1.0 2.0 4.0
      >>> print(stats.abs_mean, stats.nonzero_fraction)
      1.0 0.75
    """
    v.non_negative(atol, "atol")
    advantages = v.float_array(advantages, "advantages")
    where = v.mask_array(where, advantages.shape)
    x = jnp.where(where, advantages.astype(v.compute_dtype(advantages.dtype)), 0.0)
    mean = masked_mean(x, where)
    variance = masked_mean((x - mean) ** 2, where)
    low, high = masked_extremes(x, where)
    count = jnp.sum(where).astype(x.dtype)
    nonzero = (jnp.abs(x) > jnp.asarray(atol, x.dtype)).astype(x.dtype)
    return AdvantageStatistics(
        mean=mean,
        std=jnp.sqrt(variance),
        min=low,
        max=high,
        count=count,
        abs_mean=masked_mean(jnp.abs(x), where),
        nonzero_fraction=masked_mean(nonzero, where),
    )


def reward_statistics(
    rewards: Real[ArrayLike, "*B"], *, ddof: int = 1, where: Mask[ArrayLike, "*B"] | None = None
) -> RewardStatistics:
    r"""Mean, standard deviation, minimum and maximum of the raw, scored rewards.

    $$
    \bar r = \frac{1}{n}\sum_{i \in S} r_i, \qquad
    s = \sqrt{\frac{1}{n - d}\sum_{i \in S} (r_i - \bar r)^2}
    $$

    over the set $S$ of scored rewards (finite, and kept by `where`), $n = |S|$, $r$ =
    `rewards` and $d$ = `ddof`; min and max run over $S$. A NaN or infinite reward marks a
    completion that could not be scored and is left out, as everywhere in tunelib. With no
    scored reward every field is 0, and $s = 0$ when $n \le d$.

    What TRL and Tunix log (pass the same rewards: before any normalisation):

    * TRL's `reward` and `reward_std` are the mean and the std (`ddof=1`, the default here) of
      the weighted sum of the reward functions, a completion none of whose rewards is
      finite left out; `rewards/<name>/mean` and `/std` the same per reward function. With
      `r` `[B, K]` and weights `w`:
      ``reward_statistics(jnp.where(jnp.isnan(r).all(-1), jnp.nan, jnp.nansum(r * w, -1)))``
      and, per function, ``jax.vmap(reward_statistics, in_axes=-1)(r)``. TRL's std of a
      single reward is NaN; here it is 0.
    * Tunix's `rewards/score/mean`, `/min`, `/max` are the mean, min and max of the summed
      rewards.

    `advantage_statistics` differs: it keeps NaN entries that `where` does not mask (an
    advantage is never unscorable), takes the population std, and takes float input only.

    Args:
      rewards: `[...]` rewards, integer or float, any shape (`[B]`, `[B, G]` or a flat
        `[B*G]`: every scored reward counts once).
      ddof: 1 (default, sample std, TRL's) or 0 (population std).
      where: `[...]` mask, True (or 1) = counts; all entries count when None.

    Returns:
      A `RewardStatistics(mean, std, min, max, count)` of float32 scalars (float64 for
      float64 rewards).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import reward_statistics
      >>> stats = reward_statistics(jnp.array([1.0, 0.0, 1.0, jnp.nan]))  # 3 scored
      >>> print(stats.mean.round(4), stats.std.round(4), stats.min, stats.max, stats.count)
      0.6667 0.5774 0.0 1.0 3.0
    """
    v.check_ddof(ddof)
    rewards, valid = v.finite_entries(rewards, where, "rewards")
    count = jnp.sum(valid)
    mean = masked_mean(rewards, valid)
    squares = jnp.sum(jnp.where(valid, (rewards - mean) ** 2, 0.0))
    dof = count - ddof
    variance = jnp.where(dof > 0, squares / jnp.maximum(dof, 1).astype(rewards.dtype), 0.0)
    low, high = masked_extremes(rewards, valid)
    return RewardStatistics(
        mean=mean, std=jnp.sqrt(variance), min=low, max=high, count=count.astype(rewards.dtype)
    )


def _check_groups(rewards: jax.Array, trailing: int) -> None:
    """Groups are never guessed: `rewards` must hold them on an axis of their own."""
    if rewards.ndim < 2 + trailing:
        extra = ", K" if trailing else ""
        raise ValueError(
            f"rewards has shape {tuple(rewards.shape)}, which does not say which completions "
            f"form a group: pass [B, G{extra}], the G completions of each prompt on their own "
            f"axis (a flat rollout's rewards [B*G{extra}] reshaped with "
            f"rewards.reshape(-1, G{extra}))."
        )


def _zero_spread_fraction(
    rewards: jax.Array, valid: jax.Array, *, batch: bool, groups: str
) -> jax.Array:
    """The zero-std fraction of checked rewards (0 where invalid) with groups on the last
    axis, or the verdict on the whole array when `batch`."""
    if batch:
        rewards, valid = rewards.reshape(1, -1), valid.reshape(1, -1)
    largest = jnp.max(jnp.where(valid, rewards, -jnp.inf), axis=-1)
    smallest = jnp.min(jnp.where(valid, rewards, jnp.inf), axis=-1)
    count = jnp.sum(valid, axis=-1)
    # "scored": among groups with a valid reward, those without spread (one reward included);
    # "all": among all groups, those whose std is defined (two rewards or more) and zero.
    if groups == "scored":
        counted, flat = count > 0, largest <= smallest
    else:
        counted, flat = jnp.ones_like(count, bool), (count > 1) & (largest <= smallest)
    return masked_mean((flat & counted).astype(rewards.dtype), counted)


def zero_std_fraction(
    rewards: Real[ArrayLike, "*B G"],
    *,
    scale: Scale = "group",
    groups: Groups = "scored",
    where: Mask[ArrayLike, "*B G"] | None = None,
) -> Float[Array, ""]:
    r"""Fraction of groups whose valid rewards are all equal (zero spread).

    $$
    \frac{|\{\, g \in \mathcal{G} : \text{all valid } r_{g,i} \text{ equal} \,\}|}
         {|\mathcal{G}|}
    $$

    over the groups $g$ on the last axis of $r$ = `rewards`, $\mathcal{G}$ the groups that
    count (`groups`). Such groups have zero group-relative advantage and contribute no policy
    gradient; a fraction near 1 means the prompts are too easy or too hard for the policy.
    The test is exact (largest against smallest valid reward).

    `groups` picks the denominator, and with it how a group with few valid rewards counts:

    * ``"scored"`` (default): $\mathcal{G}$ holds the groups with at least one valid reward;
      a group with a single one has no spread. This is the complement of what
      `dynamic_sampling_mask` keeps, among those groups. If no group has a valid reward the
      result is 0.
    * ``"all"``: $\mathcal{G}$ holds every group, and a group counts as zero-std when its
      std with Bessel's correction is defined and zero: two valid rewards or more, all
      equal. This is TRL's `frac_reward_zero_std` (1.16), whose std of a group with fewer
      than two rewards is NaN, which is not close to 0; TRL compares the float32 std with 0
      to within $10^{-8}$ where this test is exact, which differs only for rewards closer
      than that.

    The two differ when some groups have fewer than two valid rewards (unscorable or masked
    completions); with every reward valid and $G \ge 2$ they agree. (TRL sets the std of
    groups of one completion, which occur only in its evaluation, to 0 and so counts them as
    zero-std; ``"all"`` does not.)

    `scale` is that of the advantages (`group_advantages`): with ``"group"`` (default) or
    ``"none"`` each group is judged on its own, as above. With ``"batch"`` the std TRL tests
    is that of the whole batch, so the fraction it logs is 1 when all valid rewards of the
    array are equal and 0 otherwise: the same verdict here, with the whole array as the one
    group (under ``"all"``, two valid rewards or more).

    Formerly `tunelib.advantages.zero_std_fraction`, still served there until tunelib 0.3.0, with a
    `DeprecationWarning`.

    Args:
      rewards: `[..., G]` rewards, integer or float, the groups on the last axis (at least one
        leading axis); NaN or infinite rewards are ignored.
      scale: ``"group"``, ``"batch"`` or ``"none"``, as the `scale` of `group_advantages`
        (static).
      groups: ``"scored"`` or ``"all"``, as above (static).
      where: `[..., G]` mask, True (or 1) = counts.

    Returns:
      A float32 scalar in $[0, 1]$ (float64 for float64 rewards).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import zero_std_fraction
      >>> rewards = jnp.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [jnp.nan, jnp.nan]])
      >>> print(zero_std_fraction(rewards).round(4))  # 2 of the 3 scored groups
      0.6667
      >>> print(zero_std_fraction(rewards, groups="all"))  # 2 of the 4 groups, as TRL
      0.5
      >>> print(zero_std_fraction(rewards, scale="batch"))  # the batch has spread
      0.0
    """
    v.one_of(scale, "scale", advantages_lib.SCALES)
    v.one_of(groups, "groups", GROUPS)
    rewards, valid = v.finite_entries(rewards, where, "rewards")
    _check_groups(rewards, trailing=0)
    return _zero_spread_fraction(rewards, valid, batch=scale == "batch", groups=groups)


def multi_reward_zero_std_fraction(
    rewards: Real[ArrayLike, "*B G K"],
    *,
    reward_weights: Real[ArrayLike, " K"] | None = None,
    combine: Combine = "sum_then_normalize",
    scale: Scale = "group",
    ddof: int = 1,
    eps: Scalar = 1e-4,
    groups: Groups = "scored",
    where: Mask[ArrayLike, "*B G"] | None = None,
) -> Float[Array, ""]:
    r"""The zero-std fraction of several rewards, as `multi_reward_advantages` combines them.

    $$
    \text{sum\_then\_normalize: } \mathrm{zsf}\Big(\sum_k w_k r_{\cdot,k}\Big), \qquad
    \text{normalize\_then\_sum: } \mathbb{1}\Big[\text{all valid } S_i \text{ equal}\Big],
    \quad S_i = \sum_k w_k N(r_{\cdot,k})_i
    $$

    with $r_{i,k}$ = `rewards`, $w_k$ = `reward_weights`, $N$ the group normalisation of
    `group_advantages` (`scale`, `ddof`, `eps`) and $\mathrm{zsf}$ = `zero_std_fraction`.
    Pass the arguments given to `multi_reward_advantages`; the result is the statistic TRL
    logs as `frac_reward_zero_std` for its `multi_objective_aggregation` of the same name
    (with ``groups="all"``, see `zero_std_fraction`):

    * ``"sum_then_normalize"``: the zero-std fraction of the weighted sum of the rewards
      (NaN rewards add nothing; a completion none of whose rewards is finite is left out),
      judged per group, or over the batch with ``scale="batch"``.
    * ``"normalize_then_sum"`` (GDPO): TRL tests the batch std of $S$, so the result is 1
      when every valid completion has the same $S$ (every reward of every group without
      spread, in practice) and 0 otherwise, whatever `scale`. $S$ is computed as
      `multi_reward_advantages` computes it, with `scale`; TRL divides each reward by its
      group std whatever its `scale_rewards`, which can only matter when two different
      reward vectors give the same $S$.

    Args:
      rewards: `[..., G, K]` rewards, integer or float, $K$ per completion (at least one
        leading axis).
      reward_weights: `[K]` weights; None (default) weighs every reward 1; may be traced.
      combine: ``"sum_then_normalize"`` or ``"normalize_then_sum"`` (static).
      scale: ``"group"``, ``"batch"`` or ``"none"`` (static).
      ddof: 1 (default) or 0, for the per-reward std of ``"normalize_then_sum"``.
      eps: $\epsilon \ge 0$ of that normalisation; may be traced.
      groups: ``"scored"`` (default) or ``"all"`` (TRL's), see `zero_std_fraction`.
      where: `[..., G]` mask over completions, True (or 1) = counts.

    Returns:
      A float32 scalar in $[0, 1]$ (float64 for float64 rewards).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import multi_reward_zero_std_fraction
      >>> rewards = jnp.array([[[1, 0], [0, 0]], [[1, 1], [1, 1]]])  # [prompts, G, K]
      >>> print(multi_reward_zero_std_fraction(rewards))  # the second group is flat
      0.5
      >>> print(multi_reward_zero_std_fraction(rewards, combine="normalize_then_sum"))
      0.0

    References:
      Liu et al., "GDPO: Group reward-Decoupled Normalization Policy Optimization for
      Multi-reward RL Optimization", 2026, https://arxiv.org/abs/2601.05242.
    """
    v.one_of(combine, "combine", advantages_lib.COMBINES)
    v.one_of(scale, "scale", advantages_lib.SCALES)
    v.one_of(groups, "groups", GROUPS)
    v.check_ddof(ddof)
    v.non_negative(eps, "eps")
    rewards = v.real_array(rewards, "rewards")
    _check_groups(rewards, trailing=1)
    where = v.mask_array(where, rewards.shape[:-1])
    rewards, weights, rows, entries = v.reward_vectors(rewards, where, reward_weights)
    if combine == "sum_then_normalize":
        summed = rewards @ weights
        return _zero_spread_fraction(summed, rows, batch=scale == "batch", groups=groups)
    per_reward = jax.vmap(
        lambda r, m: advantages_lib.group_advantages(r, scale=scale, ddof=ddof, eps=eps, where=m),
        in_axes=-1,
        out_axes=-1,
    )(rewards, entries)
    return _zero_spread_fraction(per_reward @ weights, rows, batch=True, groups=groups)
