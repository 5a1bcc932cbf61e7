r"""Losses that treat each completion's log-ratio on its own: NCA, BCO, SPPO and APO.

DPO only constrains the difference of the chosen and rejected log-ratios

$$
r_w = \log \frac{\pi_\theta(y_w)}{\pi_{\mathrm{ref}}(y_w)}, \qquad
r_l = \log \frac{\pi_\theta(y_l)}{\pi_{\mathrm{ref}}(y_l)},
$$

so both likelihoods may fall together. The losses here put a term on each, which anchors the
absolute likelihood of the chosen (and rejected) completion.
"""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float

from tunelib import _validation as v
from tunelib._typing import Scalar
from tunelib.losses import _preference_inputs as p


def _log_ratios(
    chosen_logps: ArrayLike,
    rejected_logps: ArrayLike,
    ref_chosen_logps: ArrayLike,
    ref_rejected_logps: ArrayLike,
    where: ArrayLike | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The log-ratios `r_w`, `r_l` (0 on masked rows) and the mask."""
    (chosen, rejected, ref_chosen, ref_rejected), where = p.sequence_arrays(
        where,
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    return chosen - ref_chosen, rejected - ref_rejected, where


def _scaled_log_ratios(
    chosen_logps: ArrayLike,
    rejected_logps: ArrayLike,
    ref_chosen_logps: ArrayLike,
    ref_rejected_logps: ArrayLike,
    beta: Scalar,
    where: ArrayLike | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The implicit rewards `beta * r_w`, `beta * r_l` (0 on masked rows) and the mask."""
    v.positive_scalar(beta, "beta")
    chosen, rejected, where = _log_ratios(
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, where
    )
    beta = jnp.asarray(beta, chosen.dtype)
    return beta * chosen, beta * rejected, where


def nca_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    where: Bool[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""Noise contrastive alignment (NCA) for a preference pair.

    $$
    \ell = -\log \sigma(\beta r_w) - \tfrac12 \log \sigma(-\beta r_w)
           - \tfrac12 \log \sigma(-\beta r_l)
    $$

    with $r_w$ = `chosen_logps` - `ref_chosen_logps`, $r_l$ = `rejected_logps` -
    `ref_rejected_logps` and $\beta$ = `beta`. NCA classifies each completion against noise
    instead of the pair against each other: the first term raises the chosen log-ratio, the
    last two pull both down. In $r_w$ it is minimised at $\beta r_w = \log 2$; in $r_l$ it
    rises, so the rejected log-ratio is pushed down (TRL: `loss_type="nca_pair"`).

    Args:
      chosen_logps: `[B]` policy log-probabilities of the chosen completions (sums over
        tokens).
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` reference-policy log-probabilities of the chosen completions.
      ref_rejected_logps: `[B]` reference-policy log-probabilities of the rejected ones.
      beta: $\beta > 0$; may be traced.
      where: `[B]` boolean mask, True = counts; masked rows give 0 and a zero gradient.

    Returns:
      `[B]` per-pair losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import nca_loss
      >>> chosen, rejected = jnp.array([-10.0, -12.0]), jnp.array([-14.0, -11.0])
      >>> ref_chosen, ref_rejected = jnp.array([-11.0, -12.0]), jnp.array([-13.0, -12.0])
      >>> print(nca_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5).round(4).tolist())
      [1.1982, 1.5268]

    References:
      Chen et al., "Noise Contrastive Alignment of Language Models with Explicit Rewards",
      2024, https://arxiv.org/abs/2402.05369.
    """
    chosen, rejected, where = _scaled_log_ratios(
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta, where
    )
    loss = (
        -jax.nn.log_sigmoid(chosen)
        - 0.5 * jax.nn.log_sigmoid(-chosen)
        - 0.5 * jax.nn.log_sigmoid(-rejected)
    )
    return jnp.where(where, loss, 0.0)


def bco_pair_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    delta: Scalar = 0.0,
    where: Bool[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""Binary classifier optimisation (BCO) on a pair: chosen is class 1, rejected class 0.

    $$
    \ell = -\log \sigma(\beta r_w - \delta) - \log \sigma\big(-(\beta r_l - \delta)\big)
    $$

    with $r_w$ = `chosen_logps` - `ref_chosen_logps`, $r_l$ = `rejected_logps` -
    `ref_rejected_logps`, $\beta$ = `beta` and the reward shift $\delta$ = `delta`. Each
    completion's implicit reward $\beta r$ is the logit of a binary classifier; $\delta$
    centres the rewards so that the classifier's decision boundary sits between the two
    classes. The paper sets $\delta$ to the mean implicit reward of both classes, tracked as a
    running mean over training steps; TRL kept such a running mean for
    `loss_type="bco_pair"` in earlier releases and uses $\delta = 0$ in later ones. Keep the
    running mean in your train state, e.g. `delta = (n * delta + jnp.sum(rewards)) / (n + k)`
    over the `k` values of `implicit_rewards` of both completions in each batch, under
    `jax.lax.stop_gradient`, and pass it here.

    Args:
      chosen_logps: `[B]` policy log-probabilities of the chosen completions (sums over
        tokens).
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` reference-policy log-probabilities of the chosen completions.
      ref_rejected_logps: `[B]` reference-policy log-probabilities of the rejected ones.
      beta: $\beta > 0$; may be traced.
      delta: the reward shift $\delta$, in reward units; a scalar that may be traced (it is
        differentiated only if you differentiate with respect to it).
      where: `[B]` boolean mask, True = counts; masked rows give 0 and a zero gradient.

    Returns:
      `[B]` per-pair losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import bco_pair_loss
      >>> chosen, rejected = jnp.array([-10.0, -12.0]), jnp.array([-14.0, -11.0])
      >>> ref_chosen, ref_rejected = jnp.array([-11.0, -12.0]), jnp.array([-13.0, -12.0])
      >>> loss = bco_pair_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5)
      >>> print(loss.round(4).tolist())
      [0.9482, 1.6672]

    References:
      Jung et al., "Binary Classifier Optimization for Large Language Model Alignment", 2024,
      https://arxiv.org/abs/2404.04656.
    """
    chosen, rejected, where = _scaled_log_ratios(
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta, where
    )
    delta = jnp.asarray(delta, chosen.dtype)
    loss = -jax.nn.log_sigmoid(chosen - delta) - jax.nn.log_sigmoid(delta - rejected)
    return jnp.where(where, loss, 0.0)


def sppo_hard_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    where: Bool[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""Self-play preference optimisation (SPPO) with hard win probabilities.

    $$
    \ell = \left(r_w - \frac{1}{2\beta}\right)^2 + \left(r_l + \frac{1}{2\beta}\right)^2
    $$

    with $r_w$ = `chosen_logps` - `ref_chosen_logps`, $r_l$ = `rejected_logps` -
    `ref_rejected_logps` and $\beta$ = `beta`. SPPO regresses each log-ratio onto
    $\eta\,(P(y \succ \pi_t) - \tfrac12)$; with the win probability replaced by the hard label
    (1 for the chosen, 0 for the rejected completion) and $\eta = 1/\beta$ this is the loss
    above, minimised at $r_w = 1/(2\beta)$, $r_l = -1/(2\beta)$. The reference policy is the
    previous iterate $\pi_t$ (TRL: `loss_type="sppo_hard"`).

    Args:
      chosen_logps: `[B]` policy log-probabilities of the chosen completions (sums over
        tokens).
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` log-probabilities of the chosen completions under the previous
        iterate.
      ref_rejected_logps: `[B]` log-probabilities of the rejected ones under it.
      beta: $\beta = 1/\eta > 0$; may be traced.
      where: `[B]` boolean mask, True = counts; masked rows give 0 and a zero gradient.

    Returns:
      `[B]` per-pair losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import sppo_hard_loss
      >>> chosen, rejected = jnp.array([-10.0, -12.0]), jnp.array([-14.0, -11.0])
      >>> ref_chosen, ref_rejected = jnp.array([-11.0, -12.0]), jnp.array([-13.0, -12.0])
      >>> # The first pair sits at the targets r_w = 1 / (2 beta) = 1, r_l = -1.
      >>> loss = sppo_hard_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5)
      >>> print(loss.round(4).tolist())
      [0.0, 5.0]

    References:
      Wu et al., "Self-Play Preference Optimization for Language Model Alignment", 2024,
      https://arxiv.org/abs/2405.00675.
    """
    v.positive_scalar(beta, "beta")
    chosen, rejected, where = _log_ratios(
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, where
    )
    half_target = 1 / (2 * jnp.asarray(beta, chosen.dtype))
    loss = (chosen - half_target) ** 2 + (rejected + half_target) ** 2
    return jnp.where(where, loss, 0.0)


def apo_zero_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    where: Bool[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""Anchored preference optimisation, APO-zero: raise the chosen, lower the rejected.

    $$
    \ell = \big(1 - \sigma(\beta r_w)\big) + \sigma(\beta r_l)
    $$

    with $r_w$ = `chosen_logps` - `ref_chosen_logps`, $r_l$ = `rejected_logps` -
    `ref_rejected_logps` and $\beta$ = `beta`. The loss is in $(0, 2)$, decreasing in $r_w$
    and increasing in $r_l$. Use it when the chosen completions are better than the model's
    own outputs (TRL: `loss_type="apo_zero"`).

    Args:
      chosen_logps: `[B]` policy log-probabilities of the chosen completions (sums over
        tokens).
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` reference-policy log-probabilities of the chosen completions.
      ref_rejected_logps: `[B]` reference-policy log-probabilities of the rejected ones.
      beta: $\beta > 0$; may be traced.
      where: `[B]` boolean mask, True = counts; masked rows give 0 and a zero gradient.

    Returns:
      `[B]` per-pair losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import apo_zero_loss
      >>> chosen, rejected = jnp.array([-10.0, -12.0]), jnp.array([-14.0, -11.0])
      >>> ref_chosen, ref_rejected = jnp.array([-11.0, -12.0]), jnp.array([-13.0, -12.0])
      >>> loss = apo_zero_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5)
      >>> print(loss.round(4).tolist())
      [0.7551, 1.1225]

    References:
      D'Oosterlinck et al., "Anchored Preference Optimization and Contrastive Revisions:
      Addressing Underspecification in Alignment", 2024, https://arxiv.org/abs/2408.06266.
    """
    chosen, rejected, where = _scaled_log_ratios(
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta, where
    )
    loss = jax.nn.sigmoid(-chosen) + jax.nn.sigmoid(rejected)
    return jnp.where(where, loss, 0.0)


def apo_down_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    where: Bool[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""Anchored preference optimisation, APO-down: lower both, the rejected more.

    $$
    \ell = \sigma(\beta r_w) + \big(1 - \sigma(\beta (r_w - r_l))\big)
    $$

    with $r_w$ = `chosen_logps` - `ref_chosen_logps`, $r_l$ = `rejected_logps` -
    `ref_rejected_logps` and $\beta$ = `beta`. Raising both log-ratios by the same amount
    raises the loss, so it pushes both likelihoods down while widening the margin. Use it
    when the model's own outputs are already better than the chosen completions (TRL:
    `loss_type="apo_down"`).

    Args:
      chosen_logps: `[B]` policy log-probabilities of the chosen completions (sums over
        tokens).
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` reference-policy log-probabilities of the chosen completions.
      ref_rejected_logps: `[B]` reference-policy log-probabilities of the rejected ones.
      beta: $\beta > 0$; may be traced.
      where: `[B]` boolean mask, True = counts; masked rows give 0 and a zero gradient.

    Returns:
      `[B]` per-pair losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import apo_down_loss
      >>> chosen, rejected = jnp.array([-10.0, -12.0]), jnp.array([-14.0, -11.0])
      >>> ref_chosen, ref_rejected = jnp.array([-11.0, -12.0]), jnp.array([-13.0, -12.0])
      >>> loss = apo_down_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5)
      >>> print(loss.round(4).tolist())
      [0.8914, 1.1225]

    References:
      D'Oosterlinck et al., "Anchored Preference Optimization and Contrastive Revisions:
      Addressing Underspecification in Alignment", 2024, https://arxiv.org/abs/2408.06266.
    """
    chosen, rejected, where = _scaled_log_ratios(
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, beta, where
    )
    loss = jax.nn.sigmoid(chosen) + jax.nn.sigmoid(rejected - chosen)
    return jnp.where(where, loss, 0.0)
