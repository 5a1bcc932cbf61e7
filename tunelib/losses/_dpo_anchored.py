r"""The DPO family's losses with a term on each completion's log-ratio.

NCA, BCO, SPPO and APO are links of the two log-ratios $r_w$ and $r_l$ of a pair
(`_dpo_family.py`), not of their difference alone: a term on each one anchors the absolute
likelihoods, which DPO's margin leaves free to fall together.
"""

import jax
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar
from tunelib.losses._dpo_family import on_log_ratios, with_pair_arguments


@with_pair_arguments
def nca_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    where: Mask[ArrayLike, " B"] | None = None,
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
      beta: $\beta > 0$; may be traced.

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
    v.positive_scalar(beta, "beta")
    pair = chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps
    return on_log_ratios(_nca, pair, where, beta=beta)


def _nca(r_w: jax.Array, r_l: jax.Array, *, beta: jax.Array) -> jax.Array:
    r"""NCA's link: $y_w$ against noise, and both completions' log-ratios pulled down."""
    chosen, rejected = beta * r_w, beta * r_l
    return (
        -jax.nn.log_sigmoid(chosen)
        - 0.5 * jax.nn.log_sigmoid(-chosen)
        - 0.5 * jax.nn.log_sigmoid(-rejected)
    )


@with_pair_arguments
def bco_pair_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    delta: Scalar = 0.0,
    where: Mask[ArrayLike, " B"] | None = None,
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
      beta: $\beta > 0$; may be traced.
      delta: the reward shift $\delta$, in reward units; a scalar that may be traced (it is
        differentiated only if you differentiate with respect to it).

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
    v.positive_scalar(beta, "beta")
    pair = chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps
    return on_log_ratios(_bco_pair, pair, where, beta=beta, delta=delta)


def _bco_pair(r_w: jax.Array, r_l: jax.Array, *, beta: jax.Array, delta: jax.Array) -> jax.Array:
    r"""BCO's link: the logistic losses of $y_w$ as class 1 and $y_l$ as class 0."""
    chosen, rejected = beta * r_w, beta * r_l
    return -jax.nn.log_sigmoid(chosen - delta) - jax.nn.log_sigmoid(delta - rejected)


@with_pair_arguments
def sppo_hard_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    where: Mask[ArrayLike, " B"] | None = None,
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
      beta: $\beta = 1/\eta > 0$; may be traced.

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
    pair = chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps
    return on_log_ratios(_sppo_hard, pair, where, beta=beta)


def _sppo_hard(r_w: jax.Array, r_l: jax.Array, *, beta: jax.Array) -> jax.Array:
    r"""SPPO's link with hard labels: each log-ratio's squared distance to $\pm 1/(2\beta)$."""
    half_target = 1 / (2 * beta)
    return (r_w - half_target) ** 2 + (r_l + half_target) ** 2


@with_pair_arguments
def apo_zero_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    where: Mask[ArrayLike, " B"] | None = None,
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
      beta: $\beta > 0$; may be traced.

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
    v.positive_scalar(beta, "beta")
    pair = chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps
    return on_log_ratios(_apo_zero, pair, where, beta=beta)


def _apo_zero(r_w: jax.Array, r_l: jax.Array, *, beta: jax.Array) -> jax.Array:
    r"""APO-zero's link: $1 - \sigma(\beta r_w) + \sigma(\beta r_l)$."""
    chosen, rejected = beta * r_w, beta * r_l
    return jax.nn.sigmoid(-chosen) + jax.nn.sigmoid(rejected)


@with_pair_arguments
def apo_down_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    where: Mask[ArrayLike, " B"] | None = None,
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
      beta: $\beta > 0$; may be traced.

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
    v.positive_scalar(beta, "beta")
    pair = chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps
    return on_log_ratios(_apo_down, pair, where, beta=beta)


def _apo_down(r_w: jax.Array, r_l: jax.Array, *, beta: jax.Array) -> jax.Array:
    r"""APO-down's link: $\sigma(\beta r_w) + 1 - \sigma(\beta (r_w - r_l))$."""
    chosen, rejected = beta * r_w, beta * r_l
    return jax.nn.sigmoid(chosen) + jax.nn.sigmoid(rejected - chosen)
