"""Alignment via optimal transport (AOT): distributional preference alignment over a batch."""

import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float

from tunelib import _validation as v
from tunelib._typing import Scalar
from tunelib.losses import _preference_inputs as p


def aot_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    label_smoothing: Scalar = 0.0,
    paired: bool = False,
    where: Bool[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""AOT: a logistic loss on sorted quantiles, for first-order stochastic dominance.

    $$
    \ell_{(i)} = -(1 - \varepsilon) \log \sigma(\beta \Delta_{(i)})
                 - \varepsilon \log \sigma(-\beta \Delta_{(i)}),
    \qquad \Delta_{(i)} = u_{(i)} - v_{(i)}
    $$

    where $u_{(i)}$ and $v_{(i)}$ are the $i$-th smallest of the batch's $u$ and $v$ values,
    sorted separately:

    * unpaired (`paired=False`, TRL `loss_type="aot_unpaired"`, formerly `"aot_pair"`):
      $u = r_w$ = `chosen_logps` - `ref_chosen_logps` and $v = r_l$ = `rejected_logps` -
      `ref_rejected_logps`. The chosen log-ratios are pushed to dominate the rejected ones
      quantile by quantile, without using which completions were paired.
    * paired (`paired=True`, TRL `loss_type="aot"`): $u$ = `chosen_logps` -
      `rejected_logps` and $v$ = `ref_chosen_logps` - `ref_rejected_logps`. The policy's
      margins are pushed to dominate the reference's.

    $\beta$ = `beta` and $\varepsilon$ = `label_smoothing`. With one pair both modes equal
    `dpo_loss`. Masked rows are left out of the sort.

    The loss belongs to the batch, not to its rows: position $i$ of the result is the $i$-th
    rank, the valid ranks first and the masked ranks 0. Reduce it by summing and dividing by
    the number of valid rows (the mean over valid rows), which does not depend on the order
    of the batch. The sort couples the rows, so a mean over micro-batches is not the
    full-batch mean; larger batches give finer quantiles.

    Args:
      chosen_logps: `[B]` policy log-probabilities of the chosen completions (sums over
        tokens).
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` reference-policy log-probabilities of the chosen completions.
      ref_rejected_logps: `[B]` reference-policy log-probabilities of the rejected ones.
      beta: $\beta > 0$; may be traced.
      label_smoothing: $\varepsilon \in [0, 1]$; may be traced.
      paired: static; which quantities are sorted, see above. The default is the unpaired
        form, which does not use the pairing, so row $i$'s chosen and rejected completions
        may answer different prompts.
      where: `[B]` boolean mask, True = counts. Masked rows take no part in the sort, and the
        ranks past the number of valid rows give 0 and a zero gradient.

    Returns:
      `[B]` losses per rank (ascending), float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import aot_loss
      >>> chosen, rejected = jnp.array([-10.0, -12.0]), jnp.array([-14.0, -11.0])
      >>> ref_chosen, ref_rejected = jnp.array([-11.0, -12.0]), jnp.array([-13.0, -12.0])
      >>> loss = aot_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5)
      >>> print(loss.round(4).tolist())
      [0.4741, 0.6931]
      >>> where = jnp.array([True, False])  # the second pair is padding
      >>> loss = aot_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5, where=where)
      >>> print(loss.round(4).tolist())
      [0.3133, 0.0]

    References:
      Melnyk et al., "Distributional Preference Alignment of LLMs via Optimal Transport",
      2024, https://arxiv.org/abs/2406.05882.
    """
    v.positive_scalar(beta, "beta")
    v.unit_interval(label_smoothing, "label_smoothing")
    (chosen, rejected, ref_chosen, ref_rejected), where = p.sequence_arrays(
        where,
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    if paired:
        first, second = chosen - rejected, ref_chosen - ref_rejected
    else:
        first, second = chosen - ref_chosen, rejected - ref_rejected
    # Masked rows sort last; the first `count` ranks are exactly the valid rows' quantiles.
    first = jnp.sort(jnp.where(where, first, jnp.inf))
    second = jnp.sort(jnp.where(where, second, jnp.inf))
    valid_rank = jnp.arange(where.shape[0]) < jnp.sum(where)
    delta = jnp.where(valid_rank, first - second, 0.0)
    loss = p.smoothed_logistic(jnp.asarray(beta, delta.dtype) * delta, label_smoothing)
    return jnp.where(valid_rank, loss, 0.0)
