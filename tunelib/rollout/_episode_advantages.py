"""Group-relative advantages of multi-turn episodes, per episode and per turn, on their tokens."""

from typing import Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int, Real

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar
from tunelib.advantages import group_advantages

Scale = Literal["group", "batch", "none"]
Credit = Literal["return", "turn"]
CREDITS: tuple[str, ...] = Credit.__args__


def _token_layout(turn_ids: ArrayLike, where: ArrayLike | None) -> tuple[jax.Array, jax.Array]:
    """`[B, T]` turn ids and the tokens that get an advantage: `where` and a turn id >= 0."""
    turn_ids = v.int_array(turn_ids, "turn_ids")
    if turn_ids.ndim != 2:
        raise ValueError(f"turn_ids must have shape [B, T], got {turn_ids.shape}.")
    where = v.mask_array(where, turn_ids.shape, "where")
    return turn_ids, where & (turn_ids >= 0)


def episode_advantages(
    rewards: Real[ArrayLike, " B"],
    turn_ids: Int[ArrayLike, "B T"],
    *,
    group_size: int,
    scale: Scale = "group",
    ddof: int = 1,
    eps: Scalar = 1e-4,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T"]:
    r"""Outcome advantages of episodes, group-relative, on every token of each episode.

    $$
    a_{i,t} = m_{i,t}\, A_i, \qquad
    A_i = \frac{R_i - \operatorname{mean}_{j \in g(i)} R_j}{\sigma_{g(i)} + \epsilon},
    $$

    with $R$ = `rewards` (an `Episode`'s `rewards`), $g(i)$ the `group_size` episodes of
    row $i$'s prompt, $A$ exactly `tunelib.advantages.group_advantages(rewards,
    group_size=G, scale=scale, ddof=ddof, eps=eps)` (see there for $\sigma$ under each
    `scale`, NaN rewards and constant groups) and $m$ = `where` on the tokens of the episode
    (`turn_ids >= 0`). This is GRPO on episodes: every token of episode $i$ gets its
    outcome's advantage, as TRL's and Tunix's multi-turn GRPO give it. Pass
    `where=episode.where` so that only model tokens get one (observation tokens then get
    exactly 0).

    Args:
      rewards: `[B]` episode rewards, `B = prompts * G`, row `b * G + g` episode `g` of
        prompt `b`. A NaN reward (set it on `Episode.failed` rows to leave them out of
        their group's statistics) gives 0.
      turn_ids: `[B, T]` the `Episode.turn_ids`, -1 on padding.
      group_size: $G$, a static int >= 1.
      scale: "group" (default), "batch" or "none", as for `group_advantages`.
      ddof: 1 (default) or 0, the std's delta degrees of freedom.
      eps: $\epsilon \ge 0$ (default 1e-4); may be traced.
      where: `[B, T]` mask of the tokens that get an advantage (boolean or 0/1); None: every
        token with a turn.

    Returns:
      `[B, T]` float32 token advantages (float64 for float64 rewards), 0 outside `where`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.rollout import episode_advantages
      >>> turn_ids = jnp.array([[0, 0, 1, 1], [0, 0, 0, -1]])
      >>> model = jnp.array([[True, False, True, True], [True, True, True, False]])
      >>> print(episode_advantages(jnp.array([1.0, 0.0]), turn_ids, group_size=2,
      ...                          where=model).round(3))
      [[ 0.707  0.     0.707  0.707]
       [-0.707 -0.707 -0.707  0.   ]]

    References:
      Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
      Language Models" (GRPO), 2024, https://arxiv.org/abs/2402.03300.
    """
    turn_ids, where = _token_layout(turn_ids, where)
    rewards = v.real_array(rewards, "rewards")
    if rewards.shape != turn_ids.shape[:1]:
        raise ValueError(
            f"rewards must have shape [B] = {turn_ids.shape[:1]} (a reward per row of "
            f"turn_ids {turn_ids.shape}), got {rewards.shape}."
        )
    advantages = group_advantages(rewards, group_size=group_size, scale=scale, ddof=ddof, eps=eps)
    return jnp.where(where, advantages[:, None], 0.0)


def turn_advantages(
    turn_rewards: Real[ArrayLike, "B K"],
    turn_ids: Int[ArrayLike, "B T"],
    *,
    group_size: int,
    credit: Credit = "return",
    scale: Scale = "group",
    ddof: int = 1,
    eps: Scalar = 1e-4,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T"]:
    r"""Per-turn advantages of episodes, group-relative at each turn, on the tokens of the turn.

    $$
    a_{i,t} = m_{i,t}\, A_{i,k(i,t)}, \qquad
    A_{i,k} = \frac{Q_{i,k} - \operatorname{mean}_{j \in g_k(i)} Q_{j,k}}
    {\sigma_{g_k(i)} + \epsilon}, \qquad
    Q_{i,k} = \begin{cases} \sum_{l \ge k} r_{i,l} & \texttt{credit="return"} \\
    r_{i,k} & \texttt{credit="turn"} \end{cases}
    $$

    with $r$ = `turn_rewards`, $k(i,t)$ = `turn_ids` (the turn of token $t$), $g_k(i)$ the
    episodes of row $i$'s group (`group_size` rows) that have a turn $k$, and $m$ = `where`
    on tokens with a turn. Each turn index is normalised on its own, by
    `tunelib.advantages.group_advantages` with `scale`, `ddof` and `eps` (so with
    `scale="batch"` the std is that of all episodes' turn $k$). `credit="return"` (default)
    credits a turn with the rewards from it to the end of its episode, its return to go
    (undiscounted): with a single reward at the last turn every turn gets the
    group-relative advantage of the outcome among the episodes that reached it.
    `credit="turn"` credits a turn with its own reward only, the turn-level advantage of
    MT-GRPO (Zeng et al. 2025), who add the outcome advantage to it (sum this and
    `episode_advantages` for their estimator).

    Args:
      turn_rewards: `[B, K]` rewards per turn (an `Episode`'s `turn_rewards`), `B = prompts *
        G`, row `b * G + g` episode `g` of prompt `b`. A turn counts where `turn_ids` has
        it; a NaN reward leaves that turn (and with `credit="return"`, the turns before it)
        out of its group's statistics, with advantage 0.
      turn_ids: `[B, T]` the `Episode.turn_ids`: the turn of each token, -1 on padding; ids
        outside `[0, K)` get 0.
      group_size: $G$, a static int >= 1.
      credit: "return" (default) or "turn", as above.
      scale: "group" (default), "batch" or "none", as for `group_advantages`.
      ddof: 1 (default) or 0.
      eps: $\epsilon \ge 0$ (default 1e-4); may be traced.
      where: `[B, T]` mask of the tokens that get an advantage; None: every token with a
        turn. Pass `episode.where` for model tokens only.

    Returns:
      `[B, T]` float32 token advantages (float64 for float64 rewards), 0 outside `where`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.rollout import turn_advantages
      >>> turn_rewards = jnp.array([[0.0, 1.0], [1.0, 0.0]])
      >>> turn_ids = jnp.array([[0, 0, 1, 1], [0, 1, 1, -1]])
      >>> print(turn_advantages(turn_rewards, turn_ids, group_size=2, scale="none"))
      [[ 0.   0.   0.5  0.5]
       [ 0.  -0.5 -0.5  0. ]]
      >>> print(turn_advantages(turn_rewards, turn_ids, group_size=2, credit="turn",
      ...                       scale="none"))
      [[-0.5 -0.5  0.5  0.5]
       [ 0.5 -0.5 -0.5  0. ]]

    References:
      Zeng et al., "Reinforcing Multi-Turn Reasoning in LLM Agents via Turn-Level Credit
      Assignment" (MT-GRPO), 2025, https://arxiv.org/abs/2505.11821.
      Shao et al., "DeepSeekMath" (GRPO), 2024, https://arxiv.org/abs/2402.03300.
    """
    v.one_of(credit, "credit", CREDITS)
    turn_ids, where = _token_layout(turn_ids, where)
    turn_rewards = v.real_array(turn_rewards, "turn_rewards")
    if turn_rewards.ndim != 2 or turn_rewards.shape[0] != turn_ids.shape[0]:
        raise ValueError(
            f"turn_rewards must have shape [B, K] with B = {turn_ids.shape[0]} (the rows of "
            f"turn_ids {turn_ids.shape}), got {turn_rewards.shape}."
        )
    turn_rewards = turn_rewards.astype(v.compute_dtype(turn_rewards.dtype))
    turns = turn_rewards.shape[1]
    exists = jnp.any(turn_ids[:, None, :] == jnp.arange(turns)[None, :, None], axis=-1)
    values = jnp.where(exists, turn_rewards, 0.0)
    if credit == "return":
        values = jnp.flip(jnp.cumsum(jnp.flip(values, axis=1), axis=1), axis=1)

    def per_turn(q: jax.Array, valid: jax.Array) -> jax.Array:
        return group_advantages(
            q, group_size=group_size, scale=scale, ddof=ddof, eps=eps, where=valid
        )

    advantages = jax.vmap(per_turn, in_axes=1, out_axes=1)(values, exists)
    where = where & (turn_ids < turns)
    token = jnp.take_along_axis(advantages, jnp.clip(turn_ids, 0, turns - 1), axis=1)
    return jnp.where(where, token, 0.0)
