"""The PPO value (critic) loss, with optional value clipping."""

import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float

from tunelib import _validation as v
from tunelib._typing import Scalar
from tunelib.losses._rl_inputs import token_arrays


def value_loss(
    values: Float[ArrayLike, "B T"],
    old_values: Float[ArrayLike, "B T"],
    returns: Float[ArrayLike, "B T"],
    *,
    clip_epsilon: Scalar | None = 0.2,
    where: Bool[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T"]:
    r"""Per-token squared error of the value head, clipped around the old values as in PPO2.

    $$
    \ell_t = \tfrac12 \max\Big(\big(V_t - R_t\big)^2,\;
             \big(\mathrm{clip}(V_t, V^{\mathrm{old}}_t - \varepsilon,
             V^{\mathrm{old}}_t + \varepsilon) - R_t\big)^2\Big)
    $$

    with $V$ = `values` (differentiated), $V^{\mathrm{old}}$ = `old_values` (the values the
    rollout recorded), $R$ = `returns` (for example GAE's advantages plus old values) and
    $\varepsilon$ = `clip_epsilon`. The maximum keeps the update pessimistic: once $V_t$ has
    moved more than $\varepsilon$ from $V^{\mathrm{old}}_t$ and the clipped error is the
    larger one, the token's gradient is 0 (ties go to the unclipped error). With
    ``clip_epsilon=None`` the loss is the plain $\frac12 (V_t - R_t)^2$.

    Where the sources differ: OpenAI's PPO2 baselines clip values with the policy's clip
    range (0.2, our default), TRL's PPO trainer uses `cliprange_value` = 0.2, verl's
    `cliprange_value` defaults to 0.5. Engstrom et al. 2020 and Andrychowicz et al. 2020 found
    value clipping does not help and can hurt; pass None to turn it off. The factor 1/2 is
    PPO2's and TRL's; a value-loss coefficient (`vf_coef`) is the user's to apply.

    Args:
      values: `[B, T]` current value predictions (differentiated).
      old_values: `[B, T]` value predictions recorded with the rollout.
      returns: `[B, T]` regression targets.
      clip_epsilon: $\varepsilon \ge 0$, or None for no clipping; may be traced.
      where: `[B, T]` boolean mask, True = counts. Masked tokens give exactly 0 and a zero
        gradient, even with NaN or infinite inputs there.

    Returns:
      `[B, T]` per-token losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import value_loss
      >>> values = jnp.array([[1.0, 2.0]])
      >>> old, returns = jnp.array([[0.5, 0.5]]), jnp.array([[0.0, 3.0]])
      >>> print(value_loss(values, old, returns).round(4))  # clipped to 0.7 and 0.7
      [[0.5   2.645]]
      >>> print(value_loss(values, old, returns, clip_epsilon=None).round(4))
      [[0.5 0.5]]

    References:
      Schulman et al., "Proximal Policy Optimization Algorithms", 2017,
      https://arxiv.org/abs/1707.06347.
      Engstrom et al., "Implementation Matters in Deep Policy Gradients: A Case Study on PPO
      and TRPO", 2020, https://arxiv.org/abs/2005.12729.
      Andrychowicz et al., "What Matters In On-Policy Reinforcement Learning? A Large-Scale
      Empirical Study", 2020, https://arxiv.org/abs/2006.05990.
    """
    if clip_epsilon is not None:
        v.non_negative(clip_epsilon, "clip_epsilon")
    (values, old_values, returns), where = token_arrays(
        where, values=values, old_values=old_values, returns=returns
    )
    unclipped = (values - returns) ** 2
    if clip_epsilon is None:
        return jnp.where(where, 0.5 * unclipped, 0.0)
    eps = jnp.asarray(clip_epsilon, values.dtype)
    clipped = (jnp.clip(values, old_values - eps, old_values + eps) - returns) ** 2
    return jnp.where(where, 0.5 * jnp.where(clipped > unclipped, clipped, unclipped), 0.0)
