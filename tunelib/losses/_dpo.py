r"""DPO and the losses that keep its logistic link: label-smoothed, robust, length-normalised.

Every loss here is a function of the DPO margin of a preference pair,

$$
h = \big(\log \pi_\theta(y_w) - \log \pi_\theta(y_l)\big)
  - \big(\log \pi_{\mathrm{ref}}(y_w) - \log \pi_{\mathrm{ref}}(y_l)\big),
$$

the policy's log-likelihood ratio of the chosen ($y_w$) over the rejected ($y_l$) completion
minus the reference policy's.
"""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float, Real

from tunelib import _validation as v
from tunelib._typing import Scalar
from tunelib.losses import _preference_inputs as p


def dpo_margin(
    chosen_logps: ArrayLike,
    rejected_logps: ArrayLike,
    ref_chosen_logps: ArrayLike,
    ref_rejected_logps: ArrayLike,
    where: ArrayLike | None,
) -> tuple[jax.Array, jax.Array]:
    """The checked margin `h` (0 on masked rows) and the mask."""
    (chosen, rejected, ref_chosen, ref_rejected), where = p.sequence_arrays(
        where,
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    return (chosen - rejected) - (ref_chosen - ref_rejected), where


def dpo_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    label_smoothing: Scalar = 0.0,
    where: Bool[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""Direct preference optimisation loss, with conservative label smoothing (cDPO).

    $$
    \ell = -(1 - \varepsilon) \log \sigma(\beta h) - \varepsilon \log \sigma(-\beta h),
    \qquad h = \log \frac{\pi_\theta(y_w)}{\pi_{\mathrm{ref}}(y_w)}
             - \log \frac{\pi_\theta(y_l)}{\pi_{\mathrm{ref}}(y_l)}
    $$

    with $\log \pi_\theta(y_w)$ = `chosen_logps`, $\log \pi_\theta(y_l)$ = `rejected_logps`,
    $\log \pi_{\mathrm{ref}}(y_w)$ = `ref_chosen_logps`, $\log \pi_{\mathrm{ref}}(y_l)$ =
    `ref_rejected_logps`, $\beta$ = `beta` and $\varepsilon$ = `label_smoothing`. With
    $\varepsilon = 0$ this is DPO; $\varepsilon > 0$ is conservative DPO, the cross-entropy
    against labels flipped with probability $\varepsilon$, whose minimum lies at the finite
    margin $\beta h = \log((1 - \varepsilon) / \varepsilon)$ rather than at $+\infty$ (TRL:
    `loss_type="sigmoid"` with `label_smoothing`).

    Args:
      chosen_logps: `[B]` policy log-probabilities of the chosen completions, each the sum of
        its token log-probs over the completion.
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` reference-policy log-probabilities of the chosen completions.
      ref_rejected_logps: `[B]` reference-policy log-probabilities of the rejected ones.
      beta: $\beta > 0$, the weight of the implicit KL penalty; may be traced.
      label_smoothing: $\varepsilon \in [0, 1]$, the assumed label-flip rate; may be traced.
      where: `[B]` boolean mask, True = counts. Masked rows give exactly 0 and a zero gradient,
        even when their inputs are NaN or infinite.

    Returns:
      `[B]` per-pair losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import dpo_loss
      >>> chosen, rejected = jnp.array([-10.0, -12.0]), jnp.array([-14.0, -11.0])
      >>> ref_chosen, ref_rejected = jnp.array([-11.0, -12.0]), jnp.array([-13.0, -12.0])
      >>> print(dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5).round(4).tolist())
      [0.3133, 0.9741]

    References:
      Rafailov et al., "Direct Preference Optimization: Your Language Model is Secretly a
      Reward Model", 2023, https://arxiv.org/abs/2305.18290.
      Mitchell, "A Note on DPO with Noisy Preferences & Relationship to IPO", 2023,
      https://ericmitchell.ai/cdpo.pdf.
    """
    v.positive_scalar(beta, "beta")
    v.unit_interval(label_smoothing, "label_smoothing")
    h, where = dpo_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, where)
    loss = p.smoothed_logistic(jnp.asarray(beta, h.dtype) * h, label_smoothing)
    return jnp.where(where, loss, 0.0)


def robust_dpo_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    label_smoothing: Scalar = 0.1,
    where: Bool[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""Robust DPO (rDPO): an unbiased DPO loss under labels flipped with rate $\varepsilon$.

    $$
    \ell = \frac{-(1 - \varepsilon) \log \sigma(\beta h) + \varepsilon \log \sigma(-\beta h)}
                {1 - 2 \varepsilon}
         = -\log \sigma(\beta h) - \frac{\varepsilon}{1 - 2\varepsilon} \, \beta h
    $$

    with $h$ the DPO margin of `chosen_logps`, `rejected_logps`, `ref_chosen_logps` and
    `ref_rejected_logps` (see `dpo_loss`), $\beta$ = `beta` and $\varepsilon$ =
    `label_smoothing`. If each label is swapped with probability $\varepsilon$, the expected
    rDPO loss of the observed pair equals the DPO loss of the clean pair. Unlike cDPO it can
    be negative and is unbounded below (the second form shows the linear term); it is meant
    to be averaged, not read per example (TRL: `loss_type="robust"`).

    Args:
      chosen_logps: `[B]` policy log-probabilities of the chosen completions (sums over
        tokens).
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` reference-policy log-probabilities of the chosen completions.
      ref_rejected_logps: `[B]` reference-policy log-probabilities of the rejected ones.
      beta: $\beta > 0$; may be traced.
      label_smoothing: $\varepsilon \in [0, 0.5)$, the estimated flip rate of the labels. The
        default 0.1 is our choice of a moderate noise level (the paper and TRL leave it to
        the user); $\varepsilon = 0$ gives DPO. May be traced.
      where: `[B]` boolean mask, True = counts; masked rows give 0 and a zero gradient.

    Returns:
      `[B]` per-pair losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import robust_dpo_loss
      >>> chosen, rejected = jnp.array([-10.0, -12.0]), jnp.array([-14.0, -11.0])
      >>> ref_chosen, ref_rejected = jnp.array([-11.0, -12.0]), jnp.array([-13.0, -12.0])
      >>> loss = robust_dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5)
      >>> print(loss.round(4).tolist())
      [0.1883, 1.0366]

    References:
      Chowdhury et al., "Provably Robust DPO: Aligning Language Models with Noisy Feedback",
      2024, https://arxiv.org/abs/2403.00409.
    """
    v.positive_scalar(beta, "beta")
    p.below_half(label_smoothing, "label_smoothing")
    h, where = dpo_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, where)
    logits = jnp.asarray(beta, h.dtype) * h
    eps = jnp.asarray(label_smoothing, h.dtype)
    loss = (-(1 - eps) * jax.nn.log_sigmoid(logits) + eps * jax.nn.log_sigmoid(-logits)) / (
        1 - 2 * eps
    )
    return jnp.where(where, loss, 0.0)


def _token_counts(lengths: ArrayLike, name: str, where: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Checked token counts in `dtype`, at least 1, and 1 on masked rows."""
    lengths = jnp.asarray(lengths)
    if not jnp.issubdtype(lengths.dtype, jnp.integer) and not jnp.issubdtype(
        lengths.dtype, jnp.floating
    ):
        raise TypeError(
            f"{name} must be an integer or floating-point array of token counts, got dtype "
            f"{lengths.dtype}."
        )
    v.check_shape(lengths, name, where.shape, f"chosen_logps {where.shape}")
    return jnp.maximum(jnp.where(where, lengths.astype(dtype), 1.0), 1.0)


def length_normalized_dpo_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    chosen_lengths: Real[ArrayLike, " B"],
    rejected_lengths: Real[ArrayLike, " B"],
    *,
    beta: Scalar = 5.0,
    where: Bool[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""DPO on per-token average log-probabilities of policy and reference (LN-DPO).

    $$
    \ell = -\log \sigma\!\left(\beta \left(
        \frac{\log \pi_\theta(y_w) - \log \pi_{\mathrm{ref}}(y_w)}{|y_w|}
      - \frac{\log \pi_\theta(y_l) - \log \pi_{\mathrm{ref}}(y_l)}{|y_l|}\right)\right)
    $$

    with the four sequence log-probabilities as in `dpo_loss` (sums over tokens), $|y_w|$ =
    `chosen_lengths`, $|y_l|$ = `rejected_lengths` and $\beta$ = `beta`. Averaging over
    tokens keeps the margin from growing with the completions' lengths, which counters DPO's
    drift towards longer outputs. This is the "LN-DPO" ablation of SimPO and the `dpo_norm`
    loss of Tulu 3.

    Args:
      chosen_logps: `[B]` policy log-probabilities of the chosen completions (sums over
        tokens).
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` reference-policy log-probabilities of the chosen completions.
      ref_rejected_logps: `[B]` reference-policy log-probabilities of the rejected ones.
      chosen_lengths: `[B]` token counts of the chosen completions, integer or float. A count
        below 1 (an empty completion, whose sum is 0) is treated as 1, as `sequence_mean`
        does, so the result stays finite.
      rejected_lengths: `[B]` token counts of the rejected completions.
      beta: $\beta > 0$. The default 5 is Tulu 3's value: averaged log-probs are about
        $|y|$ times smaller than sums, so $\beta$ must be about that much larger than DPO's
        0.1. May be traced.
      where: `[B]` boolean mask, True = counts; masked rows give 0 and a zero gradient.

    Returns:
      `[B]` per-pair losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import length_normalized_dpo_loss
      >>> chosen, rejected = jnp.array([-10.0, -12.0]), jnp.array([-14.0, -11.0])
      >>> ref_chosen, ref_rejected = jnp.array([-11.0, -12.0]), jnp.array([-13.0, -12.0])
      >>> lengths_w, lengths_l = jnp.array([5, 4]), jnp.array([10, 2])
      >>> loss = length_normalized_dpo_loss(
      ...     chosen, rejected, ref_chosen, ref_rejected, lengths_w, lengths_l)
      >>> print(loss.round(4).tolist())
      [0.2014, 2.5789]

    References:
      Meng et al., "SimPO: Simple Preference Optimization with a Reference-Free Reward",
      2024, https://arxiv.org/abs/2405.14734.
      Lambert et al., "Tulu 3: Pushing Frontiers in Open Language Model Post-Training", 2024,
      https://arxiv.org/abs/2411.15124.
    """
    v.positive_scalar(beta, "beta")
    (chosen, rejected, ref_chosen, ref_rejected), where = p.sequence_arrays(
        where,
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    dtype = chosen.dtype
    chosen_counts = _token_counts(chosen_lengths, "chosen_lengths", where, dtype)
    rejected_counts = _token_counts(rejected_lengths, "rejected_lengths", where, dtype)
    h = (chosen - ref_chosen) / chosen_counts - (rejected - ref_rejected) / rejected_counts
    loss = -jax.nn.log_sigmoid(jnp.asarray(beta, dtype) * h)
    return jnp.where(where, loss, 0.0)
