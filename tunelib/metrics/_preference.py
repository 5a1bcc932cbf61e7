"""What preference training logs: implicit rewards, their margins and the pair accuracy."""

import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar
from tunelib.metrics._summary import masked_mean


def implicit_rewards(
    logps: Float[ArrayLike, " B"],
    ref_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar,
    where: Mask[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""The implicit reward of a completion under DPO's reparameterisation.

    $$
    \hat r(x, y) = \beta \log \frac{\pi_\theta(y \mid x)}{\pi_{\mathrm{ref}}(y \mid x)}
    $$

    with $\log \pi_\theta(y \mid x)$ = `logps`, $\log \pi_{\mathrm{ref}}(y \mid x)$ =
    `ref_logps` and $\beta$ = `beta`, which should be the loss's own $\beta$ (it has no
    default for that reason). It is differentiable; wrap it in `jax.lax.stop_gradient` when
    it is only logged.

    Formerly `tunelib.losses.implicit_rewards`, still served there until tunelib 0.3.0, with a
    `DeprecationWarning`.

    Args:
      logps: `[B]` policy log-probabilities of the completions.
      ref_logps: `[B]` reference-policy log-probabilities of the completions.
      beta: $\beta > 0$; may be traced.
      where: `[B]` mask, True (or 1) = counts; masked rows give 0.

    Returns:
      `[B]` rewards, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import implicit_rewards
      >>> print(implicit_rewards(jnp.array([-10.0, -14.0]), jnp.array([-11.0, -13.0]), beta=0.1))
      [ 0.1 -0.1]

    References:
      Rafailov et al., "Direct Preference Optimization: Your Language Model is Secretly a
      Reward Model", 2023, https://arxiv.org/abs/2305.18290.
    """
    v.positive_scalar(beta, "beta")
    (logps, ref_logps), where = v.masked_floats(where, ndim=1, logps=logps, ref_logps=ref_logps)
    return jnp.where(where, jnp.asarray(beta, logps.dtype) * (logps - ref_logps), 0.0)


def reward_margins(
    chosen_rewards: Float[ArrayLike, " B"],
    rejected_rewards: Float[ArrayLike, " B"],
    *,
    where: Mask[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""The reward margin of each pair, $r_w - r_l$.

    With $r_w$ = `chosen_rewards` and $r_l$ = `rejected_rewards`, implicit
    (`implicit_rewards`) or from a reward model.

    Formerly `tunelib.losses.reward_margins`, still served there until tunelib 0.3.0, with a
    `DeprecationWarning`.

    Args:
      chosen_rewards: `[B]` rewards of the chosen completions.
      rejected_rewards: `[B]` rewards of the rejected completions.
      where: `[B]` mask, True (or 1) = counts; masked rows give 0.

    Returns:
      `[B]` margins, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import reward_margins
      >>> print(reward_margins(jnp.array([0.5, 0.25]), jnp.array([-0.5, 0.5])))
      [ 1.   -0.25]
    """
    (chosen, rejected), where = v.masked_floats(
        where, ndim=1, chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards
    )
    return jnp.where(where, chosen - rejected, 0.0)


def preference_accuracy(
    chosen_rewards: Float[ArrayLike, " B"],
    rejected_rewards: Float[ArrayLike, " B"],
    *,
    where: Mask[ArrayLike, " B"] | None = None,
) -> Float[Array, ""]:
    r"""The fraction of valid pairs whose chosen completion has the strictly larger reward.

    $$
    \mathrm{acc} = \frac{\sum_i m_i \,[r_{w,i} > r_{l,i}]}{\sum_i m_i}
    $$

    with $r_w$ = `chosen_rewards`, $r_l$ = `rejected_rewards` and $m$ = `where`. A tie is
    not correct, so identical rewards give 0 (TRL's `rewards/accuracies` counts ties the same
    way). A fully masked batch gives 0. For an exact mean over micro-batches, accumulate
    numerator and denominator yourself (`preference_accuracy * count`).

    Formerly `tunelib.losses.preference_accuracy`, still served there until tunelib 0.3.0, with a
    `DeprecationWarning`.

    Args:
      chosen_rewards: `[B]` rewards of the chosen completions.
      rejected_rewards: `[B]` rewards of the rejected completions.
      where: `[B]` mask, True (or 1) = counts.

    Returns:
      A scalar in $[0, 1]$, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import preference_accuracy
      >>> print(preference_accuracy(jnp.array([1.0, 0.0, 2.0]), jnp.array([0.0, 0.0, 3.0])))
      0.33333334
    """
    (chosen, rejected), where = v.masked_floats(
        where, ndim=1, chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards
    )
    return masked_mean((chosen > rejected).astype(chosen.dtype), where)
