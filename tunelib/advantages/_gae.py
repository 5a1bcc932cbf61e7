r"""Generalised advantage estimation and returns over the tokens of a completion.

Each estimator is written for one sequence as a reverse `lax.scan` over its tokens and batched
over rows with `vmap`. Token $t$ is a step of the episode: the policy emits the token, receives
the reward $r_t$ (`rewards_t`), and $V(s_t)$ (`values`) is the critic's estimate of the return
from there. Only valid tokens (`where`) are steps; without `where` every token is one. Masked
tokens inside a completion (a tool's output, say) are skipped: the recursion links each valid
token to the next valid one, as if the masked tokens were not there, and masked tokens get 0.
After the last valid token the episode ends (value 0) unless `bootstrap_value` gives the value
of the state it was cut in. The discount $\gamma$ (`gamma`) and GAE's $\lambda$ (`lambda_`) are
scalars or `[B, T]` arrays of per-step values $\gamma_t$, $\lambda_t$ (rlax's `discount_t` and
`lambda_`): $\gamma_t$ discounts what follows token $t$, so $\gamma_t = 0$ ends an episode
after token $t$ (several episodes, or turns, in one row).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Real

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar


def _token_inputs(
    rewards_t: ArrayLike,
    values: ArrayLike | None,
    bootstrap_value: ArrayLike | None,
    where: ArrayLike | None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Checked `[B, T]` rewards, values (0 when None), where (all True when None), and `[B]`
    bootstrap values.

    Rewards and values are in the compute dtype and 0 at masked tokens.
    """
    rewards_t = v.real_array(rewards_t, "rewards_t")
    if rewards_t.ndim != 2:
        raise ValueError(f"rewards_t must have shape [B, T], got {rewards_t.shape}.")
    where = v.mask_array(where, rewards_t.shape)
    dtypes = [rewards_t.dtype]
    if values is not None:
        values = v.float_array(values, "values")
        v.check_shape(values, "values", rewards_t.shape, f"rewards_t {rewards_t.shape}")
        dtypes.append(values.dtype)
    if bootstrap_value is not None:
        bootstrap_value = v.float_array(bootstrap_value, "bootstrap_value")
        v.check_shape(
            bootstrap_value, "bootstrap_value", rewards_t.shape[:1], f"rewards_t {rewards_t.shape}"
        )
        dtypes.append(bootstrap_value.dtype)
    dtype = v.compute_dtype(*dtypes)
    rewards_t = jnp.where(where, rewards_t.astype(dtype), 0.0)
    values = (
        jnp.zeros(rewards_t.shape, dtype)
        if values is None
        else jnp.where(where, values.astype(dtype), 0.0)
    )
    bootstrap_value = (
        jnp.zeros(rewards_t.shape[:1], dtype)
        if bootstrap_value is None
        else bootstrap_value.astype(dtype)
    )
    return rewards_t, values, where, bootstrap_value


def _per_step(x: ArrayLike, name: str, rewards_t: jax.Array, where: jax.Array) -> jax.Array:
    """A discount or lambda, scalar or `[B, T]`, as a `[B, T]` array in the rewards' dtype.

    A concrete `[B, T]` array must lie in [0, 1] where `where` counts; masked entries become 0
    (they are never used), so NaN there does not leak.
    """
    x = v.real_array(x, name)
    if x.ndim == 0:
        return jnp.broadcast_to(x.astype(rewards_t.dtype), rewards_t.shape)
    v.check_shape(x, name, rewards_t.shape, f"rewards_t {tuple(rewards_t.shape)}")
    if not isinstance(x, jax.core.Tracer) and not isinstance(where, jax.core.Tracer):
        counted = np.asarray(x, np.float64)[np.asarray(where)]
        bad = counted[~((counted >= 0) & (counted <= 1))]
        if bad.size:
            raise ValueError(
                f"{name} holds {bad[0]} at a counted position; per-step values lie in [0, 1]."
            )
    return jnp.where(where, x.astype(rewards_t.dtype), 0.0)


def _gae_one(
    rewards_t: jax.Array,
    values: jax.Array,
    where: jax.Array,
    bootstrap_value: jax.Array,
    gamma_t: jax.Array,
    lambda_t: jax.Array,
) -> jax.Array:
    """GAE of one sequence `[T]` with per-step discounts and lambdas, skipping masked tokens."""

    def step(carry, inputs):
        next_value, next_advantage = carry
        r_t, v_t, valid, discount, lam = inputs
        delta = r_t + discount * next_value - v_t
        advantage = delta + discount * lam * next_advantage
        carry = (
            jnp.where(valid, v_t, next_value),
            jnp.where(valid, advantage, next_advantage),
        )
        return carry, jnp.where(valid, advantage, 0.0)

    init = (bootstrap_value, jnp.zeros_like(bootstrap_value))
    inputs = (rewards_t, values, where, gamma_t, lambda_t)
    _, advantages = jax.lax.scan(step, init, inputs, reverse=True)
    return advantages


def _returns_one(
    rewards_t: jax.Array, where: jax.Array, bootstrap_value: jax.Array, gamma_t: jax.Array
) -> jax.Array:
    """Discounted reward-to-go of one sequence `[T]` with per-step discounts, skipping masked
    tokens."""

    def step(next_return, inputs):
        r_t, valid, discount = inputs
        g_t = r_t + discount * next_return
        return jnp.where(valid, g_t, next_return), jnp.where(valid, g_t, 0.0)

    _, returns = jax.lax.scan(step, bootstrap_value, (rewards_t, where, gamma_t), reverse=True)
    return returns


def _check_discounts(gamma: ArrayLike, lambda_: ArrayLike) -> None:
    v.unit_interval(gamma, "gamma")
    v.unit_interval(lambda_, "lambda_")


def gae(
    rewards_t: Real[ArrayLike, "B T"],
    values: Float[ArrayLike, "B T"],
    *,
    gamma: Scalar | Real[ArrayLike, "B T"] = 1.0,
    lambda_: Scalar | Real[ArrayLike, "B T"] = 1.0,
    bootstrap_value: Float[ArrayLike, " B"] | None = None,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T"]:
    r"""Generalised advantage estimates (GAE) of every valid token.

    $$
    \delta_t = r_t + \gamma_t V(s_{t'}) - V(s_t), \qquad
    \hat{A}_t = \delta_t + \gamma_t \lambda_t \hat{A}_{t'}
    = \sum_{l \ge 0} \Big(\prod_{j < l} \gamma_{t_j} \lambda_{t_j}\Big) \delta_{t_l}
    $$

    with $r_t$ = `rewards_t`, $V(s_t)$ = `values`, $\gamma_t$ = `gamma`, $\lambda_t$ =
    `lambda_` (each a scalar, the same at every step, or a `[B, T]` array of per-step values),
    and $t'$ the next valid token after $t$ ($t_l$ the $l$-th valid token from $t$ on,
    $t_0 = t$). After the last valid token $V = $ `bootstrap_value` (0 when None: the
    completion ended with EOS) and $\hat{A} = 0$. $\lambda = 1$ gives the Monte-Carlo
    advantage $\sum_l (\prod_{j < l} \gamma_{t_j}) r_{t_l} - V(s_t)$ (`discounted_returns`
    minus `values`); $\lambda = 0$ the one-step TD error $\delta_t$.

    Per-step values follow rlax (`truncated_generalized_advantage_estimation`, whose
    `discount_t` and `lambda_` may be per step): $\gamma_t$ discounts the step from token
    $t$ to the next valid token, so $\gamma_t = 0$ ends an episode after token $t$ and
    the tokens before it see nothing of what follows; with scalars the formula is the
    paper's, $\sum_l (\gamma\lambda)^l \delta_{t_l}$.

    Masked tokens are skipped, not treated as steps: the recursion links each valid token to
    the next valid one, so a hole in the mask (tool output inside a multi-turn completion)
    neither discounts nor adds reward. verl's GAE does the same ("skip values and TD-error on
    observation tokens"). TRL's PPO trainer and OpenRLHF zero the rewards and values at
    padding and step through every position, which agrees with this for trailing padding but
    treats a hole as a zero-reward step of value 0.

    In language-model RL the reward usually sits on the last valid token
    (`sequence_rewards_to_tokens`), often plus a per-token KL penalty; PPO for LLMs often uses
    $\gamma = 1$ and $\lambda \in [0.95, 1]$. The defaults $\gamma = \lambda = 1$ are the
    plain Monte-Carlo advantage. Values are usually under `jax.lax.stop_gradient`; the
    function is differentiable anyway.

    Args:
      rewards_t: `[B, T]` per-token rewards, integer or float.
      values: `[B, T]` value estimates $V(s_t)$ of the critic at every token.
      gamma: discount $\gamma \in [0, 1]$, or `[B, T]` per-step discounts $\gamma_t$; may
        be traced.
      lambda_: GAE parameter $\lambda \in [0, 1]$, or `[B, T]` per-step values
        $\lambda_t$; may be traced.
      bootstrap_value: `[B]` value of the state after each row's last valid token, for
        completions cut off before EOS; None (default) means 0 for every row.
      where: `[B, T]` mask of the tokens that are steps (boolean, or integer 0/1), True =
        counts: the completion mask, EOS included. None (default) makes every token of every
        row a step, for rows without padding. Masked entries give exactly 0 with zero
        gradient, even when their rewards, values or per-step discounts are NaN; a row
        without valid tokens gives 0.

    Returns:
      `[B, T]` advantages, float32 (float64 for float64 input), 0 at masked tokens.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.advantages import gae
      >>> rewards_t = jnp.array([[0.0, 0.0, 0.0, 1.0]])
      >>> values = jnp.array([[0.5, 0.6, 9.9, 0.8]])
      >>> where = jnp.array([[True, True, False, True]])  # token 2 is tool output
      >>> print(gae(rewards_t, values, gamma=0.9, lambda_=0.5, where=where).round(4))
      [[0.1345 0.21 0. 0.2]]
      >>> gamma_t = jnp.array([[0.9, 0.0, 0.9, 0.9]])  # the first episode ends at token 1
      >>> print(gae(rewards_t, values, gamma=gamma_t, lambda_=0.5, where=where).round(4))
      [[-0.23 -0.6 0. 0.2]]

    References:
      Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage
      Estimation", 2016, https://arxiv.org/abs/1506.02438.
      Ouyang et al., "Training language models to follow instructions with human feedback",
      2022, https://arxiv.org/abs/2203.02155.
    """
    _check_discounts(gamma, lambda_)
    rewards_t, values, where, bootstrap_value = _token_inputs(
        rewards_t, values, bootstrap_value, where
    )
    gamma_t = _per_step(gamma, "gamma", rewards_t, where)
    lambda_t = _per_step(lambda_, "lambda_", rewards_t, where)
    return jax.vmap(_gae_one)(rewards_t, values, where, bootstrap_value, gamma_t, lambda_t)


def lambda_returns(
    rewards_t: Real[ArrayLike, "B T"],
    values: Float[ArrayLike, "B T"],
    *,
    gamma: Scalar | Real[ArrayLike, "B T"] = 1.0,
    lambda_: Scalar | Real[ArrayLike, "B T"] = 1.0,
    bootstrap_value: Float[ArrayLike, " B"] | None = None,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T"]:
    r"""The $\lambda$-returns, GAE's targets for the value function: $\hat{A}_t + V(s_t)$.

    $$
    G^\lambda_t = \hat{A}_t + V(s_t)
    = r_t + \gamma_t \big((1 - \lambda_t) V(s_{t'}) + \lambda_t G^\lambda_{t'}\big)
    $$

    with $\hat{A}$ the `gae` of the same arguments, $V(s_t)$ = `values`, $r_t$ =
    `rewards_t`, $\gamma_t$ = `gamma`, $\lambda_t$ = `lambda_` (scalars or `[B, T]`
    per-step values, as in `gae`) and $t'$ the next valid token.
    These are the "returns" that verl, TRL and OpenRLHF regress the critic on (computed
    before any whitening of the advantages). $\lambda = 1$ gives the discounted reward-to-go
    (`discounted_returns`), $\lambda = 0$ the one-step target $r_t + \gamma V(s_{t'})$.

    Args:
      rewards_t: `[B, T]` per-token rewards, integer or float.
      values: `[B, T]` value estimates $V(s_t)$.
      gamma: discount $\gamma \in [0, 1]$, or `[B, T]` per-step discounts; may be traced.
      lambda_: $\lambda \in [0, 1]$, or `[B, T]` per-step values; may be traced.
      bootstrap_value: `[B]` value after each row's last valid token; None means 0.
      where: `[B, T]` mask of the steps (boolean, or integer 0/1), True = counts; None
        (default) makes every token a step. Masked entries give exactly 0 with zero gradient.

    Returns:
      `[B, T]` returns, float32 (float64 for float64 input), 0 at masked tokens.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.advantages import lambda_returns
      >>> rewards_t = jnp.array([[0.0, 0.0, 1.0]])
      >>> values = jnp.array([[0.5, 0.6, 0.8]])
      >>> print(lambda_returns(rewards_t, values, gamma=0.9, lambda_=0.5).round(4))  # all valid
      [[0.6345 0.81   1.    ]]

    References:
      Schulman et al., "High-Dimensional Continuous Control Using Generalized Advantage
      Estimation", 2016, https://arxiv.org/abs/1506.02438.
      Sutton and Barto, "Reinforcement Learning: An Introduction", 2nd ed., 2018, ch. 12.
    """
    advantages = gae(
        rewards_t,
        values,
        gamma=gamma,
        lambda_=lambda_,
        bootstrap_value=bootstrap_value,
        where=where,
    )
    _, values, where, _ = _token_inputs(rewards_t, values, bootstrap_value, where)
    return jnp.where(where, advantages + values, 0.0)


def discounted_returns(
    rewards_t: Real[ArrayLike, "B T"],
    *,
    gamma: Scalar | Real[ArrayLike, "B T"] = 1.0,
    bootstrap_value: Float[ArrayLike, " B"] | None = None,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T"]:
    r"""Discounted reward-to-go of every valid token.

    $$
    G_t = r_t + \gamma_t G_{t'} = \sum_{l \ge 0} \Big(\prod_{j < l} \gamma_{t_j}\Big) r_{t_l}
    $$

    with $r_t$ = `rewards_t`, $\gamma_t$ = `gamma` (a scalar, or `[B, T]` per-step
    discounts as in `gae`; a scalar gives $\sum_l \gamma^l r_{t_l}$), $t'$ the next valid
    token after $t$ and $t_l$ the $l$-th valid token from $t$ on ($t_0 = t$); after the last
    valid token $G$ = `bootstrap_value` (0 when None). With the KL-shaped token rewards
    $r_t = -\beta\,\mathrm{KL}_t$ plus the sequence reward on the last token and
    $\gamma = 1$, this is the per-token advantage of REINFORCE++ before its batch
    whitening (`whiten`).

    Args:
      rewards_t: `[B, T]` per-token rewards, integer or float.
      gamma: discount $\gamma \in [0, 1]$, or `[B, T]` per-step discounts; may be traced.
      bootstrap_value: `[B]` value after each row's last valid token; None means 0.
      where: `[B, T]` mask of the steps (boolean, or integer 0/1), True = counts; None
        (default) makes every token a step. Masked entries give exactly 0 with zero gradient,
        even when NaN; masked tokens are skipped, not discounted.

    Returns:
      `[B, T]` returns, float32 (float64 for float64 input), 0 at masked tokens.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.advantages import discounted_returns
      >>> rewards_t = jnp.array([[1.0, 0.0, jnp.nan, 2.0]])
      >>> where = jnp.array([[True, True, False, True]])
      >>> print(discounted_returns(rewards_t, gamma=0.5, where=where))
      [[1.5 1.  0.  2. ]]

    References:
      Sutton and Barto, "Reinforcement Learning: An Introduction", 2nd ed., 2018, ch. 3.
      Hu, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
      Models", 2025, https://arxiv.org/abs/2501.03262.
    """
    v.unit_interval(gamma, "gamma")
    rewards_t, _, where, bootstrap_value = _token_inputs(rewards_t, None, bootstrap_value, where)
    gamma_t = _per_step(gamma, "gamma", rewards_t, where)
    return jax.vmap(_returns_one)(rewards_t, where, bootstrap_value, gamma_t)
