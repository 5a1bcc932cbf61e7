"""Training a reward model on preference pairs: the Bradley-Terry loss."""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _deprecation
from tunelib import _validation as v
from tunelib._typing import Mask, Scalar


@_deprecation.renamed_arguments(center_coefficient="centering_weight")
def bradley_terry_loss(
    chosen_rewards: Float[ArrayLike, " B"],
    rejected_rewards: Float[ArrayLike, " B"],
    *,
    margin: Scalar | Float[ArrayLike, " B"] = 0.0,
    centering_weight: Scalar = 0.0,
    where: Mask[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""Bradley-Terry negative log-likelihood of a pair's rewards, with margin and centring.

    $$
    \ell = -\log \sigma\big(r_w - r_l - m\big) + \eta\, (r_w + r_l)^2
    $$

    with $r_w$ = `chosen_rewards`, $r_l$ = `rejected_rewards` (scalar reward-model outputs),
    $m$ = `margin` and $\eta$ = `centering_weight`. The margin (Llama 2) asks for a larger
    reward gap on pairs rated as more clearly separated; pass one value per pair. The
    centring term (Eisenstein et al.) pins the rewards' mean near 0, which the Bradley-Terry
    likelihood leaves free; they and TRL suggest $\eta = 0.01$. TRL: `RewardTrainer` with a
    `margin` column and `center_rewards_coefficient`. `centering_weight` was called
    `center_coefficient`, which still works until tunelib 0.3.0, with a `DeprecationWarning`.

    Args:
      chosen_rewards: `[B]` rewards of the chosen completions.
      rejected_rewards: `[B]` rewards of the rejected completions.
      margin: $m$, a scalar or a `[B]` array of per-pair margins; may be traced.
      centering_weight: $\eta \ge 0$; 0 (off) by default. May be traced.
      where: `[B]` mask, True (or 1) = counts; masked rows give 0 and a zero gradient.

    Returns:
      `[B]` per-pair losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import bradley_terry_loss
      >>> chosen, rejected = jnp.array([1.5, -0.5]), jnp.array([0.5, 0.0])
      >>> print(bradley_terry_loss(chosen, rejected).round(4).tolist())
      [0.3133, 0.9741]
      >>> loss = bradley_terry_loss(chosen, rejected, margin=jnp.array([1.0, 0.0]))
      >>> print(loss.round(4).tolist())
      [0.6931, 0.9741]

    References:
      Bradley and Terry, "Rank Analysis of Incomplete Block Designs: I. The Method of Paired
      Comparisons", Biometrika, 1952.
      Touvron et al., "Llama 2: Open Foundation and Fine-Tuned Chat Models", 2023,
      https://arxiv.org/abs/2307.09288.
      Eisenstein et al., "Helping or Herding? Reward Model Ensembles Mitigate but do not
      Eliminate Reward Hacking", 2023, https://arxiv.org/abs/2312.09244.
    """
    (chosen, rejected), where = v.masked_floats(
        where, ndim=1, chosen_rewards=chosen_rewards, rejected_rewards=rejected_rewards
    )
    dtype = chosen.dtype
    margin = jnp.asarray(margin)
    if margin.ndim:
        margin = v.float_array(margin, "margin")
        v.check_shape(margin, "margin", where.shape, f"chosen_rewards {where.shape}")
        margin = jnp.where(where, margin, 0.0)
    margin = margin.astype(dtype)
    loss = -jax.nn.log_sigmoid(chosen - rejected - margin)
    loss = loss + jnp.asarray(centering_weight, dtype) * (chosen + rejected) ** 2
    return jnp.where(where, loss, 0.0)
