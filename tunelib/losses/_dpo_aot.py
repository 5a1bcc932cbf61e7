r"""AOT, the DPO family's loss on the batch's sorted log-ratios.

Where the other losses of the family are links of one pair's log-ratios (`_dpo_family.py`),
AOT couples the rows of the batch: it sorts the log-ratios (or the margins) of all pairs and
applies DPO's logistic link to the differences of their quantiles.
"""

import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar
from tunelib.losses._dpo import smoothed_logistic
from tunelib.losses._dpo_family import pair_logps, with_pair_arguments


@with_pair_arguments
def aot_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    label_smoothing: Scalar = 0.0,
    paired: bool = False,
    where: Mask[ArrayLike, " B"] | None = None,
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
      beta: $\beta > 0$; may be traced.
      label_smoothing: $\varepsilon \in [0, 1]$; may be traced.
      paired: static; which quantities are sorted, see above. The default is the unpaired
        form, which does not use the pairing, so row $i$'s chosen and rejected completions
        may answer different prompts.
      where: `[B]` mask, True (or 1) = counts. Masked rows take no part in the sort, and the
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
    (chosen, rejected, ref_chosen, ref_rejected), where = pair_logps(
        (chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps), where
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
    loss = smoothed_logistic(jnp.asarray(beta, delta.dtype) * delta, label_smoothing)
    return jnp.where(valid_rank, loss, 0.0)
