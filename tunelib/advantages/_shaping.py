"""Reward shaping and data filters: token placement, DAPO's overlong and sampling filters."""

import einops
import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Real

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar
from tunelib.advantages._group import has_spread, scored_rewards


def _completion_mask(
    where: ArrayLike | None, num_tokens: int | None, *, rows: int, like: str, fn: str
) -> jax.Array:
    """The `[B, T]` mask `where` as booleans, or all True `[B, num_tokens]` when it is None."""
    if num_tokens is not None:
        v.static_int(num_tokens, "num_tokens", what="a Python int >= 1 (a static value)")
        v.number_in(num_tokens, "num_tokens", low=1)
    if where is None:
        if num_tokens is None:
            raise ValueError(
                f"{fn} needs the number of tokens T of each row: pass where, the [B, T] "
                "completion mask, or num_tokens=T when every token counts."
            )
        return jnp.ones((rows, num_tokens), jnp.bool_)
    where = v.mask_like(where, "where")
    if where.ndim != 2 or where.shape[0] != rows:
        raise ValueError(
            f"where has shape {where.shape} but must have shape [B, T] with B = {rows} to "
            f"match {like}."
        )
    if num_tokens is not None and where.shape[1] != num_tokens:
        raise ValueError(
            f"num_tokens={num_tokens} does not match where of shape {where.shape} (T = "
            f"{where.shape[1]}); pass one of them."
        )
    return where


def sequence_rewards_to_tokens(
    rewards: Real[ArrayLike, " B"],
    *,
    num_tokens: int | None = None,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T"]:
    r"""Place each sequence's reward on its last valid token, 0 on every other token.

    $$
    r_{i,t} = \begin{cases} R_i & t = \max\{s : m_{i,s}\} \\ 0 & \text{otherwise} \end{cases}
    $$

    with $R$ = `rewards` and $m$ = `where`. This is how an outcome reward enters per-token
    estimators (`gae`, `discounted_returns`), usually added to a per-token KL penalty. The last
    valid token is the EOS token when the completion mask includes it, as it should.

    Args:
      rewards: `[B]` sequence rewards, integer or float (cast, never truncated). A NaN reward
        on a row with valid tokens stays NaN on its last token: mask unscorable rows out.
      num_tokens: $T$, a static int >= 1, for `where=None`: every token counts and each
        reward lands on position $T - 1$ of its row. With `where` it may be left out (it must
        equal `where.shape[1]` if given).
      where: `[B, T]` completion mask (boolean, or integer 0/1), True = counts. A row without
        valid tokens gets no reward (all 0), whatever its reward. None (default) counts every
        token of `num_tokens`; one of the two is required.

    Returns:
      `[B, T]` token rewards, float32 (float64 for float64 rewards).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.advantages import sequence_rewards_to_tokens
      >>> where = jnp.array([[True, True, False], [True, True, True], [False, False, False]])
      >>> print(sequence_rewards_to_tokens(jnp.array([1, -2, 5]), where=where))
      [[ 0.  1.  0.]
       [ 0.  0. -2.]
       [ 0.  0.  0.]]
      >>> print(sequence_rewards_to_tokens(jnp.array([1, -2]), num_tokens=3))
      [[ 0.  0.  1.]
       [ 0.  0. -2.]]
    """
    rewards = v.real_array(rewards, "rewards")
    if rewards.ndim != 1:
        raise ValueError(f"rewards must have shape [B], got {rewards.shape}.")
    where = _completion_mask(
        where,
        num_tokens,
        rows=rewards.shape[0],
        like=f"rewards {rewards.shape}",
        fn="sequence_rewards_to_tokens",
    )
    rewards = rewards.astype(v.compute_dtype(rewards.dtype))
    num_tokens = where.shape[1]
    last = num_tokens - 1 - jnp.argmax(where[:, ::-1], axis=-1)
    is_last = (jnp.arange(num_tokens) == last[:, None]) & where
    return jnp.where(is_last, rewards[:, None], 0.0)


def overlong_penalty(
    lengths: Real[ArrayLike, " B"], *, max_length: Scalar, buffer_length: Scalar
) -> Float[Array, " B"]:
    r"""DAPO's soft overlong punishment: a length penalty that ramps to -1 near the limit.

    $$
    R_{\mathrm{length}}(y) = \begin{cases}
      0 & |y| \le L_{\max} - L_{\mathrm{cache}} \\
      \dfrac{(L_{\max} - L_{\mathrm{cache}}) - |y|}{L_{\mathrm{cache}}}
        & L_{\max} - L_{\mathrm{cache}} < |y| \le L_{\max} \\
      -1 & L_{\max} < |y|
    \end{cases}
    $$

    with $|y|$ = `lengths` (completion lengths in tokens), $L_{\max}$ = `max_length` and
    $L_{\mathrm{cache}}$ = `buffer_length`. It is added to the task reward of each completion
    before the group advantages are taken. DAPO uses $L_{\max} = 20480$ and
    $L_{\mathrm{cache}} = 4096$ (so the penalty starts at 16384 tokens); TRL's soft overlong
    reward takes the same two numbers (`max_completion_len`, `soft_punish_cache`).

    Args:
      lengths: `[B]` completion lengths in tokens, integer or float.
      max_length: $L_{\max} > 0$, where the penalty reaches -1; may be traced.
      buffer_length: $L_{\mathrm{cache}} > 0$, the length of the ramp; may be traced.

    Returns:
      `[B]` penalties in $[-1, 0]$, float32 (float64 for float64 lengths).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.advantages import overlong_penalty
      >>> lengths = jnp.array([100, 160, 170, 200, 250])
      >>> print(overlong_penalty(lengths, max_length=200, buffer_length=40))
      [ 0.    0.   -0.25 -1.   -1.  ]

    References:
      Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", 2025,
      https://arxiv.org/abs/2503.14476.
    """
    lengths = v.real_array(lengths, "lengths")
    if lengths.ndim != 1:
        raise ValueError(f"lengths must have shape [B], got {lengths.shape}.")
    v.positive_scalar(max_length, "max_length")
    v.positive_scalar(buffer_length, "buffer_length")
    if (
        isinstance(max_length, int | float)
        and isinstance(buffer_length, int | float)
        and buffer_length > max_length
    ):
        raise ValueError(
            f"buffer_length must be <= max_length, got buffer_length={buffer_length} and "
            f"max_length={max_length}."
        )
    dtype = v.compute_dtype(lengths.dtype)
    max_length = jnp.asarray(max_length, dtype)
    buffer_length = jnp.asarray(buffer_length, dtype)
    ramp = ((max_length - buffer_length) - lengths.astype(dtype)) / buffer_length
    return jnp.clip(ramp, -1.0, 0.0)


def truncation_mask(
    truncated: Mask[ArrayLike, " B"],
    *,
    num_tokens: int | None = None,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Bool[Array, "B T"]:
    r"""The completion mask with truncated completions removed (DAPO's overlong filtering).

    $$
    m'_{i,t} = m_{i,t} \wedge \neg\,\mathrm{truncated}_i
    $$

    with $m$ = `where` and `truncated` True for the completions that hit the length limit
    without an EOS token. DAPO masks the loss of such completions: penalising a sound but
    unfinished line of reasoning for its length adds noise to the reward. Use the result as
    the `where` of the policy loss and of `tunelib.losses.aggregate`. The completions still
    count in their group's reward statistics; to leave them out of those too, pass
    `where=~truncated` to `group_advantages` (with `group_size=G` for the flat `[B*G]` rows
    of a rollout). `overlong_penalty` is DAPO's softer alternative.

    Args:
      truncated: `[B]` True (or 1) for completions that ended without EOS, as
        `tunelib.rollout.Rollout.truncated`.
      num_tokens: $T$, a static int >= 1, for `where=None`: every token of a completion that
        was not truncated counts. With `where` it may be left out (it must equal
        `where.shape[1]` if given).
      where: `[B, T]` completion mask (boolean, or integer 0/1), True = counts. None
        (default) counts every token of `num_tokens`; one of the two is required.

    Returns:
      `[B, T]` boolean mask, False on every token of a truncated completion.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.advantages import truncation_mask
      >>> where = jnp.array([[True, True, False], [True, True, True]])
      >>> print(truncation_mask(jnp.array([False, True]), where=where))
      [[ True  True False]
       [False False False]]
      >>> print(truncation_mask(jnp.array([0, 1]), num_tokens=2))
      [[ True  True]
       [False False]]

    References:
      Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", 2025,
      https://arxiv.org/abs/2503.14476.
    """
    truncated = v.mask_like(truncated, "truncated")
    if truncated.ndim != 1:
        raise ValueError(f"truncated must have shape [B], got {truncated.shape}.")
    where = _completion_mask(
        where,
        num_tokens,
        rows=truncated.shape[0],
        like=f"truncated {truncated.shape}",
        fn="truncation_mask",
    )
    return where & ~truncated[:, None]


def dynamic_sampling_mask(
    rewards: Real[ArrayLike, "*B G"],
    *,
    group_size: int | None = None,
    where: Mask[ArrayLike, "*B G"] | None = None,
) -> Bool[Array, "*B"] | Bool[Array, " BG"]:
    r"""DAPO's dynamic-sampling filter: True for groups whose valid rewards are not all equal.

    $$
    \mathrm{keep} = \big|\{\, r_i : m_i,\ r_i \text{ finite} \,\}\big| > 1
    $$

    the number of distinct valid rewards in the group ($r$ = `rewards`, last axis; $m$ =
    `where`) exceeds one. A group whose completions all got the same reward (all right or
    all wrong) has zero group-relative advantage and so gives no gradient; DAPO over-samples
    prompts and keeps only groups with spread until the batch is full. Groups with fewer than
    2 valid rewards are dropped. The comparison is exact (no tolerance); TRL's
    zero-std statistic compares the std with 0 up to `torch.isclose`.

    Args:
      rewards: `[..., G]` rewards, integer or float, the groups on the last axis (at least
        one leading axis); or flat `[B*G]`, completion `g` of prompt `b` in row `b * G + g`,
        with `group_size`. NaN or infinite rewards are ignored.
      group_size: None (default) for `[..., G]` rewards; $G$, a static int >= 1, for flat
        `[B*G]` rewards. A 1-D `rewards` without it is a `ValueError`.
      where: mask of the layout of `rewards` (boolean, or integer 0/1), True = counts; None
        (default) keeps every completion.

    Returns:
      `[...]` boolean, True for the groups to keep; for flat rewards `[B*G]`, one entry per
      completion, True for every completion of a group to keep (a row mask for the batch).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.advantages import dynamic_sampling_mask
      >>> rewards = jnp.array([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0], [0.0, jnp.nan, 0.0]])
      >>> print(dynamic_sampling_mask(rewards))
      [ True False False]
      >>> print(dynamic_sampling_mask(jnp.array([1, 0, 1, 1]), group_size=2))
      [ True  True False False]

    References:
      Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", 2025,
      https://arxiv.org/abs/2503.14476.
    """
    rewards, valid = scored_rewards(rewards, where, group_size=group_size)
    keep = has_spread(rewards, valid)
    if group_size is None:
        return keep
    return einops.repeat(keep, "b -> (b g)", g=group_size)
