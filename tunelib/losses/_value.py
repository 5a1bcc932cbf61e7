"""The PPO value (critic) loss, with optional value clipping."""

import functools
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _deprecation
from tunelib import _validation as v
from tunelib._typing import Mask, Scalar


def _accept_clip_epsilon(fn: Callable) -> Callable:
    """Serve the old symmetric `clip_epsilon=x` as `epsilon_low=x, epsilon_high=x`."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "clip_epsilon" in kwargs:
            if "epsilon_low" in kwargs or "epsilon_high" in kwargs:
                raise TypeError(
                    "value_loss() got both 'clip_epsilon' (deprecated) and 'epsilon_low' / "
                    "'epsilon_high'; pass 'epsilon_low' and 'epsilon_high' only."
                )
            _deprecation.warn(
                "value_loss(clip_epsilon=...)", "value_loss(epsilon_low=..., epsilon_high=...)"
            )
            kwargs["epsilon_low"] = kwargs["epsilon_high"] = kwargs.pop("clip_epsilon")
        return fn(*args, **kwargs)

    return wrapper


@_accept_clip_epsilon
def value_loss(
    values: Float[ArrayLike, "B T"],
    old_values: Float[ArrayLike, "B T"],
    returns: Float[ArrayLike, "B T"],
    *,
    epsilon_low: Scalar | None = 0.2,
    epsilon_high: Scalar | None = 0.2,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> Float[Array, "B T"]:
    r"""Per-token squared error of the value head, clipped around the old values as in PPO2.

    $$
    \ell_t = \tfrac12 \max\Big(\big(V_t - R_t\big)^2,\;
             \big(\mathrm{clip}(V_t, V^{\mathrm{old}}_t - \varepsilon_{\mathrm{low}},
             V^{\mathrm{old}}_t + \varepsilon_{\mathrm{high}}) - R_t\big)^2\Big)
    $$

    with $V$ = `values` (differentiated), $V^{\mathrm{old}}$ = `old_values` (the values the
    rollout recorded), $R$ = `returns` (for example GAE's advantages plus old values),
    $\varepsilon_{\mathrm{low}}$ = `epsilon_low` and $\varepsilon_{\mathrm{high}}$ =
    `epsilon_high`. The maximum keeps the update pessimistic: once $V_t$ has moved past a
    bound from $V^{\mathrm{old}}_t$ and the clipped error is the larger one, the token's
    gradient is 0 (ties go to the unclipped error). A bound that is None leaves that side
    unclipped; with both None the loss is the plain $\frac12 (V_t - R_t)^2$.

    Where the sources differ: OpenAI's PPO2 baselines clip values symmetrically with the
    policy's clip range (0.2, our defaults), TRL's PPO trainer uses `cliprange_value` = 0.2,
    verl's `cliprange_value` defaults to 0.5. Engstrom et al. 2020 and Andrychowicz et al. 2020
    found value clipping does not help and can hurt; pass None for both to turn it off. The
    factor 1/2 is PPO2's and TRL's; a value-loss weight (`vf_coef`) is the user's to apply.

    The single symmetric bound was called `clip_epsilon`; ``clip_epsilon=x`` still works until
    tunelib 0.3.0, as ``epsilon_low=x, epsilon_high=x``, with a `DeprecationWarning`.

    Args:
      values: `[B, T]` current value predictions (differentiated).
      old_values: `[B, T]` value predictions recorded with the rollout.
      returns: `[B, T]` regression targets.
      epsilon_low: $\varepsilon_{\mathrm{low}} \ge 0$, how far below the old value the
        prediction is clipped, or None for no lower bound; may be traced.
      epsilon_high: $\varepsilon_{\mathrm{high}} \ge 0$, how far above, or None; may be traced.
      where: `[B, T]` mask, True (or 1) = counts. Masked tokens give exactly 0 and a zero
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
      >>> print(value_loss(values, old, returns, epsilon_low=None, epsilon_high=None).round(4))
      [[0.5 0.5]]

    References:
      Schulman et al., "Proximal Policy Optimization Algorithms", 2017,
      https://arxiv.org/abs/1707.06347.
      Engstrom et al., "Implementation Matters in Deep Policy Gradients: A Case Study on PPO
      and TRPO", 2020, https://arxiv.org/abs/2005.12729.
      Andrychowicz et al., "What Matters In On-Policy Reinforcement Learning? A Large-Scale
      Empirical Study", 2020, https://arxiv.org/abs/2006.05990.
    """
    for bound, name in ((epsilon_low, "epsilon_low"), (epsilon_high, "epsilon_high")):
        if bound is not None:
            v.non_negative(bound, name)
    (values, old_values, returns), where = v.masked_floats(
        where, ndim=2, values=values, old_values=old_values, returns=returns
    )
    unclipped = (values - returns) ** 2
    if epsilon_low is None and epsilon_high is None:
        return jnp.where(where, 0.5 * unclipped, 0.0)
    dtype = values.dtype
    low = None if epsilon_low is None else old_values - jnp.asarray(epsilon_low, dtype)
    high = None if epsilon_high is None else old_values + jnp.asarray(epsilon_high, dtype)
    clipped = (jnp.clip(values, low, high) - returns) ** 2
    return jnp.where(where, 0.5 * jnp.where(clipped > unclipped, clipped, unclipped), 0.0)
