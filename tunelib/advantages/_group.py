r"""Group-relative advantages: GRPO, Dr. GRPO, RLOO, and several rewards (GRPO or GDPO).

Every estimator here sees the rewards of the $G$ completions sampled for one prompt and uses
the other completions of the group as the baseline. The groups are never guessed: rewards come
as `[..., G]`, the groups on the last axis, or flat as `[B*G]` (completion `g` of prompt `b` in
row `b * G + g`, the layout `tunelib.rollout.sample(..., group_size=G)` returns) with
`group_size=G`; the result has the layout the rewards came in. A reward that is NaN or infinite
marks a completion that could not be scored: it is left out of every statistic and gets an
advantage of exactly 0, as does a completion masked out by `where`.
"""

import functools
from typing import Literal

import einops
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Real

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar
from tunelib.advantages._whitening import masked_moments

Scale = Literal["group", "batch", "none"]
SCALES: tuple[str, ...] = Scale.__args__
Combine = Literal["sum_then_normalize", "normalize_then_sum"]
COMBINES: tuple[str, ...] = Combine.__args__


def split_groups(
    x: jax.Array, group_size: int | None, *, name: str, trailing: int = 0
) -> jax.Array:
    """`x` with the completions of each group on an axis of their own, `[..., G, *E]`.

    Without `group_size`, `x` must already be `[..., G, *E]` with at least one axis before the
    group axis and is returned as it is; with `group_size=G` it must be flat, `[B*G, *E]`,
    and is split into `[B, G, *E]`. `E` are the `trailing` axes after the group axis (the $K$
    rewards of each completion). Anything else is a `ValueError` that names both layouts.
    """
    extra = ", K" if trailing else ""
    if group_size is None:
        if x.ndim < 2 + trailing:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)}, which does not say which completions form "
                f"a group. Pass {name} as [B, G{extra}], the G completions of each prompt on "
                f"their own axis, or flat as [B*G{extra}] (completion g of prompt b in row "
                f"b * G + g, as `sample(..., group_size=G)` returns them) with group_size=G."
            )
        return x
    v.static_int(group_size, "group_size", what="a Python int >= 1 (a static value)")
    v.number_in(group_size, "group_size", low=1)
    if x.ndim != 1 + trailing:
        raise ValueError(
            f"group_size={group_size} is for flat {name} [B*G{extra}], but {name} has shape "
            f"{tuple(x.shape)}: as [B, G{extra}] it holds its groups on axis {-1 - trailing} "
            "already; drop group_size."
        )
    if x.shape[0] % group_size:
        raise ValueError(
            f"{name} has {x.shape[0]} completions (shape {tuple(x.shape)}), which is not a "
            f"multiple of group_size={group_size}."
        )
    return einops.rearrange(x, "(b g) ... -> b g ...", g=group_size)


def merge_groups(x: jax.Array, group_size: int | None) -> jax.Array:
    """Undo `split_groups`: `[B, G, ...]` back to flat `[B*G, ...]` when `group_size` is set."""
    if group_size is None:
        return x
    return einops.rearrange(x, "b g ... -> (b g) ...")


def scored_rewards(
    rewards: ArrayLike,
    where: ArrayLike | None,
    *,
    group_size: int | None = None,
    name: str = "rewards",
) -> tuple[jax.Array, jax.Array]:
    """Rewards `[..., G]` in the compute dtype (0 where invalid) and the valid mask.

    A completion is valid when `where` keeps it and its reward is finite. Flat rewards with
    `group_size` come back split into `[B, G]` (see `split_groups`).
    """
    rewards, valid = v.finite_entries(rewards, where, name)
    split = functools.partial(split_groups, group_size=group_size, name=name)
    return split(rewards), split(valid)


def has_spread(rewards: jax.Array, valid: jax.Array) -> jax.Array:
    """`[...]` True where the valid rewards of the group (last axis) are not all equal.

    The comparison is exact (largest against smallest valid reward), so a group of equal
    rewards is detected even when its mean does not round back to the common value.
    """
    rewards = jax.lax.stop_gradient(rewards)
    largest = jnp.max(jnp.where(valid, rewards, -jnp.inf), axis=-1)
    smallest = jnp.min(jnp.where(valid, rewards, jnp.inf), axis=-1)
    return largest > smallest


def _safe_divide(x: jax.Array, denominator: jax.Array) -> jax.Array:
    """`x / denominator`, and 0 where the denominator is 0."""
    positive = denominator > 0
    return jnp.where(positive, x / jnp.where(positive, denominator, 1.0), 0.0)


def _std(var: jax.Array) -> jax.Array:
    """`sqrt(var)` with a finite gradient at `var = 0`."""
    positive = var > 0
    return jnp.where(positive, jnp.sqrt(jnp.where(positive, var, 1.0)), 0.0)


def _check_options(scale: str, ddof: int, eps: Scalar) -> None:
    v.one_of(scale, "scale", SCALES)
    v.check_ddof(ddof)
    v.non_negative(eps, "eps")


def _normalize(
    rewards: jax.Array, valid: jax.Array, *, scale: str, ddof: int, eps: Scalar
) -> jax.Array:
    """Group-relative advantages along the last axis of checked rewards (0 where invalid)."""
    mean, var, _ = masked_moments(rewards, valid, axis=-1, ddof=ddof)
    centered = rewards - mean
    if scale == "none":
        advantages = centered
    else:
        if scale == "batch":
            _, var, _ = masked_moments(rewards, valid, axis=None, ddof=ddof)
        advantages = _safe_divide(centered, _std(var) + jnp.asarray(eps, rewards.dtype))
    keep = valid & has_spread(rewards, valid)[..., None]
    return jnp.where(keep, advantages, 0.0)


def group_advantages(
    rewards: Real[ArrayLike, "*B G"],
    *,
    group_size: int | None = None,
    scale: Scale = "group",
    ddof: int = 1,
    eps: Scalar = 1e-4,
    where: Mask[ArrayLike, "*B G"] | None = None,
) -> Float[Array, "*B G"]:
    r"""Group-relative advantages of GRPO: each reward against its group's mean and spread.

    $$
    A_i = \frac{r_i - \operatorname{mean}(r_1, \dots, r_G)}{\sigma + \epsilon}
    $$

    with $r$ = `rewards` (the $G$ completions of one prompt) and $\epsilon$ = `eps`. The
    divisor $\sigma$ depends on `scale`:

    * ``"group"`` (default; GRPO, Shao et al. 2024): the std of the group's rewards.
    * ``"batch"``: the std of all valid rewards of the array, around their global mean, while
      the mean stays the group's (LitePPO, Liu et al. 2025, "group mean, batch std"; TRL's
      `scale_rewards="batch"`). A group of near-equal rewards then keeps a small advantage
      instead of being blown up to unit scale.
    * ``"none"``: no division, $A_i = r_i - \operatorname{mean}$ (Dr. GRPO, Liu et al. 2025,
      who show that dividing by the group std biases updates towards too-easy and too-hard
      prompts; TRL's `scale_rewards="none"`).

    The std uses `ddof` (1 = Bessel's correction). TRL computes it with `torch.std`
    (`ddof=1`) and adds $\epsilon = 10^{-4}$; Tunix uses `ddof=1` and $\epsilon = 10^{-6}$;
    OpenRLHF's group normalisation uses $\epsilon = 10^{-9}$. Our defaults are `ddof=1` and
    `eps=1e-4`, TRL's. With several completions per prompt `ddof` matters: for $G = 4$ the
    population std is $\sqrt{3/4} \approx 0.87$ times the sample std.

    Defined results for every input: a completion whose reward is NaN or infinite (it could
    not be scored) or that `where` masks out is left out of the mean and the std and gets
    exactly 0; the other completions get what they would get if it were absent. A group
    whose valid rewards are all equal (one valid reward, or none, included) gives exactly 0,
    never NaN and never a rounding residue, for every `scale` and every `eps` (0 included).
    Integer rewards are cast to float, never truncated.

    Args:
      rewards: `[..., G]` rewards, integer or float; the last axis is the group of
        completions of one prompt, the leading axes (at least one) index prompts. Or flat
        `[B*G]`, completion `g` of prompt `b` in row `b * G + g`, with `group_size`.
      group_size: None (default) for `[..., G]` rewards; $G$, a static int >= 1, for flat
        `[B*G]` rewards. A 1-D `rewards` without `group_size` is a `ValueError`: one group
        is never assumed.
      scale: ``"group"``, ``"batch"`` or ``"none"``, as above.
      ddof: 1 (default, sample std) or 0 (population std).
      eps: $\epsilon \ge 0$, added to the std; may be traced.
      where: mask of the layout of `rewards` (boolean, or integer 0/1), True = counts; None
        (default) keeps every completion. A masked completion is left out as if its reward
        were NaN.

    Returns:
      Advantages in the layout of `rewards` (`[..., G]`, or `[B*G]` with `group_size`),
      float32 (float64 for float64 rewards), one per completion; spread them over the
      completion's tokens (GRPO gives every token its sequence's advantage).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.advantages import group_advantages
      >>> rewards = jnp.array([[1, 0, 0, 1], [1, 1, 1, 1], [2, 0, 1, jnp.nan]])
      >>> print(group_advantages(rewards).round(4))
      [[ 0.866 -0.866 -0.866  0.866]
       [ 0.     0.     0.     0.   ]
       [ 0.9999 -0.9999  0.     0.   ]]
      >>> print(group_advantages(rewards, scale="none").round(4))
      [[ 0.5 -0.5 -0.5  0.5]
       [ 0.   0.   0.   0. ]
       [ 1.  -1.   0.   0. ]]
      >>> flat = jnp.array([1, 0, 0, 1, 2, 0])  # two prompts, three completions each
      >>> print(group_advantages(flat, group_size=3, scale="none").round(4))
      [ 0.6667 -0.3333 -0.3333  0.      1.     -1.    ]

    References:
      Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
      Models", 2024, https://arxiv.org/abs/2402.03300.
      Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective", 2025,
      https://arxiv.org/abs/2503.20783.
      Liu et al., "Part I: Tricks or Traps? A Deep Dive into RL for LLM Reasoning", 2025,
      https://arxiv.org/abs/2508.08221.
    """
    _check_options(scale, ddof, eps)
    rewards, valid = scored_rewards(rewards, where, group_size=group_size)
    return merge_groups(_normalize(rewards, valid, scale=scale, ddof=ddof, eps=eps), group_size)


def multi_reward_advantages(
    rewards: Real[ArrayLike, "*B G K"],
    *,
    group_size: int | None = None,
    reward_weights: Real[ArrayLike, " K"] | None = None,
    combine: Combine = "sum_then_normalize",
    scale: Scale = "group",
    ddof: int = 1,
    eps: Scalar = 1e-4,
    where: Mask[ArrayLike, "*B G"] | None = None,
) -> Float[Array, "*B G"]:
    r"""Group-relative advantages from $K$ rewards per completion, combined in one of two orders.

    $$
    A^{\mathrm{sum}}_i = N\Big(\sum_k w_k \, r_{\cdot,k}\Big)_i, \qquad
    A^{\mathrm{GDPO}}_i = \frac{S_i - \operatorname{mean}_{\mathrm{batch}}(S)}
                              {\operatorname{std}_{\mathrm{batch}}(S) + \epsilon}, \qquad
    S_i = \sum_k w_k \, N(r_{\cdot,k})_i
    $$

    with $r_{i,k}$ = `rewards` (completion $i$ of a group, reward $k$), $w_k$ =
    `reward_weights`, $\epsilon$ = `eps` and $N$ the group normalisation of
    `group_advantages` with the same `scale`, `ddof` and `eps`. `combine` picks the order:

    * ``"sum_then_normalize"`` (default; GRPO with several reward functions, TRL's
      `reward_weights` and its default `multi_objective_aggregation`): $A^{\mathrm{sum}}$,
      the weighted sum of the rewards normalised within the group.
    * ``"normalize_then_sum"`` (GDPO, Liu et al. 2026; TRL's `"normalize_then_sum"`):
      $A^{\mathrm{GDPO}}$, each reward normalised within the group on its own, the results
      summed with the weights, and the sum normalised over all valid completions of the
      batch. Summing first lets different reward combinations collapse onto the same
      advantage (with two binary rewards, a group whose sums are (0, 1) and one whose sums
      are (0, 2) get identical advantages); normalising each reward first keeps them apart,
      and the batch step keeps the scale from growing with $K$. With ``scale="none"`` there
      is no division anywhere and $A_i = S_i$.

    A reward that is NaN or infinite means "this reward does not apply to this completion":
    it adds nothing to the weighted sum (TRL sums reward functions with `nansum`), and under
    ``"normalize_then_sum"`` it is also left out of that reward's group statistics. A
    completion none of whose $K$ rewards is finite, or that `where` masks out, is left out
    everywhere and gets exactly 0. A group whose combined advantages do not vary gives
    exactly 0 (its rows still count in the batch statistics of ``"normalize_then_sum"``,
    which differs from the paper's formula only by the batch mean of $S$, zero up to rounding
    when every reward is finite).

    Args:
      rewards: `[..., G, K]` rewards, integer or float: $K$ rewards for each of the $G$
        completions of each prompt (at least one leading axis). Or flat `[B*G, K]`,
        completion `g` of prompt `b` in row `b * G + g`, with `group_size`.
      group_size: None (default) for `[..., G, K]` rewards; $G$, a static int >= 1, for flat
        `[B*G, K]` rewards. A 2-D `rewards` without `group_size` is a `ValueError`.
      reward_weights: `[K]` weights $w_k$; None (default) weighs every reward 1, as TRL
        does. May be traced.
      combine: ``"sum_then_normalize"`` or ``"normalize_then_sum"``, as above.
      scale: ``"group"``, ``"batch"`` or ``"none"``, the normalisation $N$ (see
        `group_advantages`).
      ddof: 1 (default) or 0, for every std.
      eps: $\epsilon \ge 0$, added to every std; may be traced.
      where: mask over completions (boolean, or integer 0/1), `[..., G]` (or `[B*G]` with
        `group_size`), True = counts; None (default) keeps every completion.

    Returns:
      Advantages `[..., G]` (or `[B*G]` with `group_size`), float32 (float64 for float64
      rewards).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.advantages import multi_reward_advantages
      >>> rewards = jnp.array([[[0, 0], [0, 1]], [[0, 0], [1, 1]]])  # [prompts, G, K]
      >>> print(multi_reward_advantages(rewards).round(3))  # both groups collapse
      [[-0.707  0.707]
       [-0.707  0.707]]
      >>> print(multi_reward_advantages(rewards, combine="normalize_then_sum").round(4))
      [[-0.5477  0.5477]
       [-1.0954  1.0954]]

    References:
      Liu et al., "GDPO: Group reward-Decoupled Normalization Policy Optimization for
      Multi-reward RL Optimization", 2026, https://arxiv.org/abs/2601.05242.
      Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
      Models", 2024, https://arxiv.org/abs/2402.03300.
    """
    _check_options(scale, ddof, eps)
    v.one_of(combine, "combine", COMBINES)
    rewards = v.real_array(rewards, "rewards")
    where = v.mask_array(where, rewards.shape[:-1])
    rewards = split_groups(rewards, group_size, name="rewards", trailing=1)
    where = split_groups(where, group_size, name="where")
    rewards, weights, rows, entries = v.reward_vectors(rewards, where, reward_weights)
    normalize = functools.partial(_normalize, scale=scale, ddof=ddof, eps=eps)
    if combine == "sum_then_normalize":
        return merge_groups(normalize(rewards @ weights, rows), group_size)
    per_reward = jax.vmap(normalize, in_axes=-1, out_axes=-1)(rewards, entries)
    summed = per_reward @ weights
    if scale == "none":
        return merge_groups(jnp.where(rows, summed, 0.0), group_size)
    mean, var, _ = masked_moments(summed, rows, axis=None, ddof=ddof)
    advantages = _safe_divide(summed - mean, _std(var) + jnp.asarray(eps, rewards.dtype))
    keep = rows & has_spread(summed, rows)[..., None]
    return merge_groups(jnp.where(keep, advantages, 0.0), group_size)


def rloo_advantages(
    rewards: Real[ArrayLike, "*B G"],
    *,
    group_size: int | None = None,
    where: Mask[ArrayLike, "*B G"] | None = None,
) -> Float[Array, "*B G"]:
    r"""REINFORCE leave-one-out advantages: each reward against the mean of the others.

    $$
    A_i = r_i - \frac{1}{G - 1} \sum_{j \ne i} r_j = \frac{G}{G - 1}\,(r_i - \bar{r})
    $$

    with $r$ = `rewards` (the $G$ completions of one prompt) and $\bar{r}$ their mean. The
    baseline of each completion does not depend on its own reward, so the policy-gradient
    estimate stays unbiased. Invalid completions (NaN or infinite reward, or masked by
    `where`) are left out: $G$ counts the valid ones, and they get 0. A group with fewer than
    2 valid completions, or whose valid rewards are all equal, gives exactly 0.

    Args:
      rewards: `[..., G]` rewards, integer or float, the groups on the last axis (at least
        one leading axis); or flat `[B*G]` with `group_size`, as in `group_advantages`.
      group_size: None (default) for `[..., G]` rewards; $G$, a static int >= 1, for flat
        `[B*G]` rewards. A 1-D `rewards` without it is a `ValueError`.
      where: mask of the layout of `rewards` (boolean, or integer 0/1), True = counts; None
        (default) keeps every completion.

    Returns:
      Advantages in the layout of `rewards`, float32 (float64 for float64 rewards).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.advantages import rloo_advantages
      >>> print(rloo_advantages(jnp.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, jnp.nan]])))
      [[ 0.6666667 -0.6666667 -0.6666667  0.6666667]
       [ 1.5       -1.5        0.         0.       ]]

    References:
      Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning
      from Human Feedback in LLMs", 2024, https://arxiv.org/abs/2402.14740.
      Kool et al., "Buy 4 REINFORCE Samples, Get a Baseline for Free!", 2019,
      https://openreview.net/forum?id=r1lgTGL5DE.
    """
    rewards, valid = scored_rewards(rewards, where, group_size=group_size)
    mean, _, count = masked_moments(rewards, valid, axis=-1, ddof=0)
    count = count.astype(rewards.dtype)
    advantages = count / jnp.maximum(count - 1, 1) * (rewards - mean)
    keep = valid & has_spread(rewards, valid)[..., None]
    return merge_groups(jnp.where(keep, advantages, 0.0), group_size)
