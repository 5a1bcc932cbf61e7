r"""Per-pair weights for preference losses: WPO's weighting by the policy's own probabilities."""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar
from tunelib.losses._dpo_variants import token_pairs


def _mean_aligned(token_logps: jax.Array, log_norms: jax.Array, mask: jax.Array) -> jax.Array:
    """Per row, the mean over valid tokens of `token_logps - log_norms`; 0 for an empty row."""
    count = jnp.maximum(jnp.sum(mask, axis=-1), 1).astype(token_logps.dtype)
    return jnp.sum(token_logps - log_norms, axis=-1) / count


def wpo_weights(
    chosen_token_logps: Float[ArrayLike, "B Tc"],
    rejected_token_logps: Float[ArrayLike, "B Tr"],
    chosen_log_sum_sq_probs: Float[ArrayLike, "B Tc"],
    rejected_log_sum_sq_probs: Float[ArrayLike, "B Tr"],
    *,
    max_weight: Scalar | None = 1.0,
    chosen_where: Mask[ArrayLike, "B Tc"] | None = None,
    rejected_where: Mask[ArrayLike, "B Tr"] | None = None,
    where: Mask[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""Weighted preference optimisation (WPO): weight each pair by how likely the policy makes it.

    $$
    w = \min\big(w(y_w)\, w(y_l),\; w_{\max}\big), \qquad
    w(y) = \exp\!\Big(\frac{1}{|y|} \sum_{t=1}^{|y|}
           \log \frac{\pi_\theta(y_t \mid x, y_{<t})}{\sum_{v} \pi_\theta(v \mid x, y_{<t})^2}\Big)
    $$

    with $\log \pi_\theta(y_t \mid x, y_{<t})$ = `chosen_token_logps` (for $y_w$) and
    `rejected_token_logps` (for $y_l$), $\log \sum_v \pi_\theta(v \mid x, y_{<t})^2$ =
    `chosen_log_sum_sq_probs` and `rejected_log_sum_sq_probs`, $|y|$ the number of valid
    tokens of `chosen_where` (`rejected_where`) and $w_{\max}$ = `max_weight`. Multiply the
    weights into any per-pair preference loss, `w * dpo_loss(...)`, then reduce as usual.

    Off-policy pairs (written by another model) that the policy would rarely produce get small
    weights, pairs it might have sampled itself larger ones: this simulates on-policy training
    on off-policy data. Each token's probability is divided by
    $\sum_v \pi_\theta(v)^2$, the probability it would have on average if the policy sampled
    it ("sampled alignment"), so the policy's own samples weigh about 1 whatever its
    entropy; the paper's "greedy alignment" divides by $\max_v \pi_\theta(v)$ instead: pass
    `jnp.max(log_probs, axis=-1)` in place of the log sum of squares. The weights carry no
    gradient (`jax.lax.stop_gradient`), as in the paper and TRL.

    With the full `[B, T, V]` log-probs at hand, the sum of squares is
    `jax.nn.logsumexp(2 * log_probs, axis=-1)` (with `log_probs =
    jax.nn.log_softmax(logits / temperature, axis=-1)`). TRL 1.16 (`DPOConfig.use_weighting`,
    `DPOTrainer._compute_loss`) computes exactly this with its fused head and multiplies the
    weights into every `loss_type` but the AOT ones, without a cap: `max_weight=None`. The WPO
    authors' code, and TRL up to 0.28, cap the product at 1: `max_weight=1.0`, the default.
    An empty completion (no valid token) has a mean of 0 and $w(y) = 1$, as in TRL.

    Args:
      chosen_token_logps: `[B, Tc]` per-token log-probabilities of the chosen completions
        under the policy being trained.
      rejected_token_logps: `[B, Tr]` per-token log-probabilities of the rejected ones.
      chosen_log_sum_sq_probs: `[B, Tc]` $\log \sum_v \pi_\theta(v \mid x, y_{<t})^2$ at each
        position of the chosen completions (at most 0).
      rejected_log_sum_sq_probs: `[B, Tr]` the same for the rejected completions.
      max_weight: $w_{\max} > 0$, a cap on each pair's weight (may be traced), or None for no
        cap (static). For valid inputs $w(y) \le V$, so uncapped weights stay finite.
      chosen_where: `[B, Tc]` mask of the chosen completions' tokens; None = every token.
      rejected_where: `[B, Tr]` mask of the rejected completions' tokens.
      where: `[B]` mask of the pairs, True (or 1) = counts; masked pairs get weight 0.

    Returns:
      `[B]` pair weights, float32 (float64 for float64 input), without gradient.

    Examples:
      >>> import jax
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import wpo_weights
      >>> log_probs = jax.nn.log_softmax(jnp.array([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]]))
      >>> log_sum_sq = jax.nn.logsumexp(2 * log_probs, axis=-1)
      >>> chosen = jnp.take_along_axis(log_probs, jnp.array([[[0], [1]]]), -1)[..., 0]
      >>> rejected = jnp.take_along_axis(log_probs, jnp.array([[[2], [2]]]), -1)[..., 0]
      >>> # The policy's likely tokens weigh more than 1, its unlikely ones less.
      >>> w = wpo_weights(chosen, rejected, log_sum_sq, log_sum_sq, max_weight=None)
      >>> print(w.round(4).tolist())
      [0.3736]

    References:
      Zhou et al., "WPO: Enhancing RLHF with Weighted Preference Optimization", 2024,
      https://arxiv.org/abs/2406.11827.
    """
    if max_weight is not None:
        v.positive_scalar(max_weight, "max_weight")
    (chosen, chosen_norms), chosen_mask, (rejected, rejected_norms), rejected_mask, where = (
        token_pairs(
            {
                "chosen_token_logps": chosen_token_logps,
                "chosen_log_sum_sq_probs": chosen_log_sum_sq_probs,
            },
            {
                "rejected_token_logps": rejected_token_logps,
                "rejected_log_sum_sq_probs": rejected_log_sum_sq_probs,
            },
            chosen_where,
            rejected_where,
            where,
        )
    )
    log_weight = _mean_aligned(chosen, chosen_norms, chosen_mask) + _mean_aligned(
        rejected, rejected_norms, rejected_mask
    )
    weights = jnp.exp(log_weight)
    if max_weight is not None:
        weights = jnp.minimum(weights, jnp.asarray(max_weight, weights.dtype))
    return jax.lax.stop_gradient(jnp.where(where, weights, 0.0))
