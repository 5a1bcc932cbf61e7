r"""The DPO family: preference losses on a pair's log-ratios against a reference model.

Every loss here takes the four `[B]` sequence log-probabilities of a preference pair, the
policy's and the reference model's for the chosen ($y_w$) and the rejected ($y_l$)
completion, through their log-ratios

$$
r_w = \log \frac{\pi_\theta(y_w)}{\pi_{\mathrm{ref}}(y_w)}, \qquad
r_l = \log \frac{\pi_\theta(y_l)}{\pi_{\mathrm{ref}}(y_l)}, \qquad
h = r_w - r_l.
$$

DPO and its label-smoothed, robust and length-normalised forms keep the logistic link on the
margin $h$; IPO, the hinge (SLiC), EXO and DiscoPOP replace the link; NCA, BCO, SPPO and APO
put a term on each log-ratio, which anchors the absolute likelihoods; AOT sorts the batch's
log-ratios and compares quantiles.
"""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Real

from tunelib import _deprecation
from tunelib import _validation as v
from tunelib._typing import Mask, Scalar


def smoothed_logistic(logits: jax.Array, label_smoothing: ArrayLike) -> jax.Array:
    r"""$-(1 - \varepsilon) \log \sigma(x) - \varepsilon \log \sigma(-x)$, computed stably.

    The logistic loss against labels flipped with probability $\varepsilon$ (cDPO's), shared
    by the losses that keep DPO's link (here, AOT, SimPO and CPO).
    """
    eps = jnp.asarray(label_smoothing, logits.dtype)
    return -(1 - eps) * jax.nn.log_sigmoid(logits) - eps * jax.nn.log_sigmoid(-logits)


def _pair(
    chosen_logps: ArrayLike,
    rejected_logps: ArrayLike,
    ref_chosen_logps: ArrayLike,
    ref_rejected_logps: ArrayLike,
    where: ArrayLike | None,
) -> tuple[list[jax.Array], jax.Array]:
    """The four checked `[B]` log-probs (0 on masked rows) and the mask."""
    return v.masked_floats(
        where,
        ndim=1,
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )


def dpo_margin(
    chosen_logps: ArrayLike,
    rejected_logps: ArrayLike,
    ref_chosen_logps: ArrayLike,
    ref_rejected_logps: ArrayLike,
    where: ArrayLike | None,
) -> tuple[jax.Array, jax.Array]:
    """The checked margin `h` (0 on masked rows) and the mask."""
    (chosen, rejected, ref_chosen, ref_rejected), where = _pair(
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, where
    )
    return (chosen - rejected) - (ref_chosen - ref_rejected), where


def _log_ratios(
    chosen_logps: ArrayLike,
    rejected_logps: ArrayLike,
    ref_chosen_logps: ArrayLike,
    ref_rejected_logps: ArrayLike,
    where: ArrayLike | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The log-ratios `r_w`, `r_l` (0 on masked rows) and the mask."""
    (chosen, rejected, ref_chosen, ref_rejected), where = _pair(
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, where
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


# Losses on the margin h with DPO's logistic link.


def dpo_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    label_smoothing: Scalar = 0.0,
    where: Mask[ArrayLike, " B"] | None = None,
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
    $\varepsilon = 0$ this is DPO (TRL: `loss_type="sigmoid"`). $\varepsilon > 0$ is
    Mitchell's conservative DPO (cDPO), the cross-entropy against labels flipped with
    probability $\varepsilon$, whose minimum lies at the finite margin
    $\beta h = \log((1 - \varepsilon) / \varepsilon)$ rather than at $+\infty$. Tunix's DPO
    computes it with `label_smoothing` (`DPOTrainingConfig`, 0.1.7), and so did TRL's
    `"sigmoid"` up to 0.28; TRL 1.16's `"sigmoid"` ignores `label_smoothing`, which it reads
    only for `"robust"` (rDPO, `robust_dpo_loss`, a different loss: unbiased rather than
    conservative), `"exo_pair"` and the AOT losses, so it has no cDPO.

    Args:
      chosen_logps: `[B]` policy log-probabilities of the chosen completions, each the sum of
        its token log-probs over the completion.
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` reference-policy log-probabilities of the chosen completions.
      ref_rejected_logps: `[B]` reference-policy log-probabilities of the rejected ones.
      beta: $\beta > 0$, the weight of the implicit KL penalty; may be traced.
      label_smoothing: $\varepsilon \in [0, 1]$, the assumed label-flip rate; may be traced.
      where: `[B]` mask, True (or 1) = counts. Masked rows give exactly 0 and a zero gradient,
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
    loss = smoothed_logistic(jnp.asarray(beta, h.dtype) * h, label_smoothing)
    return jnp.where(where, loss, 0.0)


def robust_dpo_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    label_smoothing: Scalar = 0.1,
    where: Mask[ArrayLike, " B"] | None = None,
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
      where: `[B]` mask, True (or 1) = counts; masked rows give 0 and a zero gradient.

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
    v.number_in(label_smoothing, "label_smoothing", low=0, high=0.5, high_open=True)
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
    where: Mask[ArrayLike, " B"] | None = None,
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
    drift towards longer outputs. This is the "LN-DPO" ablation of SimPO, the `dpo_norm`
    loss of Tulu 3 and TRL 1.16's `loss_type="sigmoid_norm"` (which divides by the completion
    mask's token counts).

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
      where: `[B]` mask, True (or 1) = counts; masked rows give 0 and a zero gradient.

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
    (chosen, rejected, ref_chosen, ref_rejected), where = _pair(
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, where
    )
    dtype = chosen.dtype
    chosen_counts = _token_counts(chosen_lengths, "chosen_lengths", where, dtype)
    rejected_counts = _token_counts(rejected_lengths, "rejected_lengths", where, dtype)
    h = (chosen - ref_chosen) / chosen_counts - (rejected - ref_rejected) / rejected_counts
    loss = -jax.nn.log_sigmoid(jnp.asarray(beta, dtype) * h)
    return jnp.where(where, loss, 0.0)


# Losses that replace the logistic link by another function of the margin.


def ipo_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    where: Mask[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""Identity preference optimisation (IPO): the squared distance of the margin to a target.

    $$
    \ell = \left(h - \frac{1}{2\beta}\right)^2
    $$

    with $h$ the DPO margin of `chosen_logps`, `rejected_logps`, `ref_chosen_logps` and
    `ref_rejected_logps` (see `dpo_loss`) and $\beta$ = `beta` (the paper's $\tau$). The
    target margin $1/(2\beta)$ is finite, so IPO does not push deterministic preferences to
    infinity as DPO can. The paper's experiments and TRL (`loss_type="ipo"`) use per-token
    average log-probabilities: pass `sequence_mean` values to reproduce them; with sums the
    same $\beta$ sets a target that ignores length.

    Args:
      chosen_logps: `[B]` policy log-probabilities of the chosen completions.
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` reference-policy log-probabilities of the chosen completions.
      ref_rejected_logps: `[B]` reference-policy log-probabilities of the rejected ones.
      beta: $\beta > 0$ (TRL's default 0.1 puts the target margin at 5); may be traced.
      where: `[B]` mask, True (or 1) = counts; masked rows give 0 and a zero gradient.

    Returns:
      `[B]` per-pair losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import ipo_loss
      >>> chosen, rejected = jnp.array([-1.0, -1.2]), jnp.array([-1.4, -1.1])
      >>> ref_chosen, ref_rejected = jnp.array([-1.1, -1.2]), jnp.array([-1.3, -1.2])
      >>> # The first pair sits at the target margin 1 / (2 beta) = 0.2.
      >>> print(ipo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=2.5).round(4).tolist())
      [0.0, 0.09]

    References:
      Azar et al., "A General Theoretical Paradigm to Understand Learning from Human
      Preferences", 2023, https://arxiv.org/abs/2310.12036.
    """
    v.positive_scalar(beta, "beta")
    h, where = dpo_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, where)
    loss = (h - 1 / (2 * jnp.asarray(beta, h.dtype))) ** 2
    return jnp.where(where, loss, 0.0)


def hinge_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    where: Mask[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""Hinge loss on the DPO margin (SLiC calibration loss, normalised by the reference).

    $$
    \ell = \max(0,\; 1 - \beta h)
    $$

    with $h$ the DPO margin of `chosen_logps`, `rejected_logps`, `ref_chosen_logps` and
    `ref_rejected_logps` (see `dpo_loss`) and $\beta$ = `beta`. SLiC writes
    $\max(0, \delta - \log \pi_\theta(y_w) + \log \pi_\theta(y_l))$ without a reference model;
    this is that loss divided by $\delta = 1/\beta$ with the reference log-ratio subtracted, the
    "normalised likelihood" form of RSO and TRL (`loss_type="hinge"`). Pass zeros as the
    reference log-probs for SLiC's original, up to the factor $\delta$.

    Args:
      chosen_logps: `[B]` policy log-probabilities of the chosen completions.
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` reference-policy log-probabilities of the chosen completions.
      ref_rejected_logps: `[B]` reference-policy log-probabilities of the rejected ones.
      beta: $\beta > 0$, the inverse of the margin $\delta$; may be traced.
      where: `[B]` mask, True (or 1) = counts; masked rows give 0 and a zero gradient.

    Returns:
      `[B]` per-pair losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import hinge_loss
      >>> chosen, rejected = jnp.array([-10.0, -12.0]), jnp.array([-14.0, -11.0])
      >>> ref_chosen, ref_rejected = jnp.array([-11.0, -12.0]), jnp.array([-13.0, -12.0])
      >>> print(hinge_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5).round(4).tolist())
      [0.0, 1.5]

    References:
      Zhao et al., "SLiC-HF: Sequence Likelihood Calibration with Human Feedback", 2023,
      https://arxiv.org/abs/2305.10425.
      Liu et al., "Statistical Rejection Sampling Improves Preference Optimization", 2023,
      https://arxiv.org/abs/2309.06657.
    """
    v.positive_scalar(beta, "beta")
    h, where = dpo_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, where)
    loss = jax.nn.relu(1 - jnp.asarray(beta, h.dtype) * h)
    return jnp.where(where, loss, 0.0)


@_deprecation.renamed_arguments(epsilon="label_smoothing")
def exo_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    label_smoothing: Scalar = 1e-3,
    where: Mask[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""Efficient exact optimisation (EXO) for a pair: reverse KL to smoothed labels.

    $$
    \ell = \sigma(\beta h) \log \frac{\sigma(\beta h)}{1 - \varepsilon}
         + \sigma(-\beta h) \log \frac{\sigma(-\beta h)}{\varepsilon}
    $$

    with $h$ the DPO margin of `chosen_logps`, `rejected_logps`, `ref_chosen_logps` and
    `ref_rejected_logps` (see `dpo_loss`), $\beta$ = `beta` and $\varepsilon$ =
    `label_smoothing`.
    $\sigma(\beta h)$ is the model's probability that $y_w$ wins the pair; the loss is the KL
    divergence from that two-point distribution to the labels $(1 - \varepsilon,
    \varepsilon)$. DPO minimises the forward KL between the same distributions; the reverse
    KL is mode-seeking. It is 0 exactly at $\beta h = \log((1 - \varepsilon)/\varepsilon)$ (TRL:
    `loss_type="exo_pair"`, whose `label_smoothing` is this $\varepsilon$). Formerly
    `epsilon`, which still works until tunelib 0.3.0, with a `DeprecationWarning`.

    Args:
      chosen_logps: `[B]` policy log-probabilities of the chosen completions.
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` reference-policy log-probabilities of the chosen completions.
      ref_rejected_logps: `[B]` reference-policy log-probabilities of the rejected ones.
      beta: $\beta > 0$; may be traced.
      label_smoothing: $\varepsilon \in (0, 1)$, the label smoothing that keeps the KL finite;
        the default $10^{-3}$ is the paper's and TRL's. May be traced.
      where: `[B]` mask, True (or 1) = counts; masked rows give 0 and a zero gradient.

    Returns:
      `[B]` per-pair losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import exo_loss
      >>> chosen, rejected = jnp.array([-10.0, -12.0]), jnp.array([-14.0, -11.0])
      >>> ref_chosen, ref_rejected = jnp.array([-11.0, -12.0]), jnp.array([-13.0, -12.0])
      >>> print(exo_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5).round(4).tolist())
      [1.2763, 3.6373]

    References:
      Ji et al., "Towards Efficient Exact Optimization of Language Model Alignment", 2024,
      https://arxiv.org/abs/2402.00856.
    """
    v.positive_scalar(beta, "beta")
    v.unit_interval(label_smoothing, "label_smoothing", closed=False)
    h, where = dpo_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, where)
    logits = jnp.asarray(beta, h.dtype) * h
    eps = jnp.asarray(label_smoothing, h.dtype)
    log_win, log_lose = jax.nn.log_sigmoid(logits), jax.nn.log_sigmoid(-logits)
    loss = jnp.exp(log_win) * (log_win - jnp.log1p(-eps)) + jnp.exp(log_lose) * (
        log_lose - jnp.log(eps)
    )
    return jnp.where(where, loss, 0.0)


def discopop_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.05,
    tau: Scalar = 0.05,
    where: Mask[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""DiscoPOP, the log-ratio modulated loss: a logistic-exponential blend gated by the margin.

    $$
    \ell = \big(1 - \sigma(\rho / \tau)\big)\big(-\log \sigma(\rho)\big)
         + \sigma(\rho / \tau)\, e^{-\rho},
    \qquad \rho = \beta h
    $$

    with $h$ the DPO margin of `chosen_logps`, `rejected_logps`, `ref_chosen_logps` and
    `ref_rejected_logps` (see `dpo_loss`), $\beta$ = `beta` and $\tau$ = `tau`. Negative
    margins get DPO's logistic loss, positive ones the exponential loss, with a sigmoid of
    temperature $\tau$ between them. The exponential term is computed as
    $\exp(\log \sigma(\rho/\tau) - \rho)$, so a very negative $\rho$ gives no $\infty \cdot 0$;
    for $\tau < 1$ it is then at most 1, for $\tau \ge 1$ it grows without bound as
    $\rho \to -\infty$ (TRL: `loss_type="discopop"`, with `discopop_tau`).

    Args:
      chosen_logps: `[B]` policy log-probabilities of the chosen completions.
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` reference-policy log-probabilities of the chosen completions.
      ref_rejected_logps: `[B]` reference-policy log-probabilities of the rejected ones.
      beta: $\beta > 0$; the default 0.05 is the paper's (TRL uses its DPO default 0.1).
        May be traced.
      tau: $\tau > 0$, the temperature of the gate; the default 0.05 is the paper's and
        TRL's. May be traced.
      where: `[B]` mask, True (or 1) = counts; masked rows give 0 and a zero gradient.

    Returns:
      `[B]` per-pair losses, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import discopop_loss
      >>> chosen, rejected = jnp.array([-10.0, -12.0]), jnp.array([-14.0, -11.0])
      >>> ref_chosen, ref_rejected = jnp.array([-11.0, -12.0]), jnp.array([-13.0, -12.0])
      >>> # rho = 1: exp(-1) = 0.3679; rho = -0.5: -log sigmoid(-0.5) = 0.9741.
      >>> loss = discopop_loss(chosen, rejected, ref_chosen, ref_rejected, beta=0.5)
      >>> print(loss.round(4).tolist())
      [0.3679, 0.9741]

    References:
      Lu et al., "Discovering Preference Optimization Algorithms with and for Large Language
      Models", 2024, https://arxiv.org/abs/2406.08414.
    """
    v.positive_scalar(beta, "beta")
    v.positive_scalar(tau, "tau")
    h, where = dpo_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, where)
    rho = jnp.asarray(beta, h.dtype) * h
    gate_logits = rho / jnp.asarray(tau, h.dtype)
    logistic = jax.nn.sigmoid(-gate_logits) * -jax.nn.log_sigmoid(rho)
    exponential = jnp.exp(jax.nn.log_sigmoid(gate_logits) - rho)
    return jnp.where(where, logistic + exponential, 0.0)


# Losses with a term on each completion's log-ratio.


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
      chosen_logps: `[B]` policy log-probabilities of the chosen completions (sums over
        tokens).
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` reference-policy log-probabilities of the chosen completions.
      ref_rejected_logps: `[B]` reference-policy log-probabilities of the rejected ones.
      beta: $\beta > 0$; may be traced.
      where: `[B]` mask, True (or 1) = counts; masked rows give 0 and a zero gradient.

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
      chosen_logps: `[B]` policy log-probabilities of the chosen completions (sums over
        tokens).
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` reference-policy log-probabilities of the chosen completions.
      ref_rejected_logps: `[B]` reference-policy log-probabilities of the rejected ones.
      beta: $\beta > 0$; may be traced.
      delta: the reward shift $\delta$, in reward units; a scalar that may be traced (it is
        differentiated only if you differentiate with respect to it).
      where: `[B]` mask, True (or 1) = counts; masked rows give 0 and a zero gradient.

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
      chosen_logps: `[B]` policy log-probabilities of the chosen completions (sums over
        tokens).
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` log-probabilities of the chosen completions under the previous
        iterate.
      ref_rejected_logps: `[B]` log-probabilities of the rejected ones under it.
      beta: $\beta = 1/\eta > 0$; may be traced.
      where: `[B]` mask, True (or 1) = counts; masked rows give 0 and a zero gradient.

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
      chosen_logps: `[B]` policy log-probabilities of the chosen completions (sums over
        tokens).
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` reference-policy log-probabilities of the chosen completions.
      ref_rejected_logps: `[B]` reference-policy log-probabilities of the rejected ones.
      beta: $\beta > 0$; may be traced.
      where: `[B]` mask, True (or 1) = counts; masked rows give 0 and a zero gradient.

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
      chosen_logps: `[B]` policy log-probabilities of the chosen completions (sums over
        tokens).
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` reference-policy log-probabilities of the chosen completions.
      ref_rejected_logps: `[B]` reference-policy log-probabilities of the rejected ones.
      beta: $\beta > 0$; may be traced.
      where: `[B]` mask, True (or 1) = counts; masked rows give 0 and a zero gradient.

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


# A loss on the batch's sorted log-ratios.


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
    (chosen, rejected, ref_chosen, ref_rejected), where = _pair(
        chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, where
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
