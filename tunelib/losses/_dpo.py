r"""The DPO family's losses on the margin: DPO's logistic link and the links that replace it.

Each loss is a link, a function of the margin $h = r_w - r_l$ of a pair's log-ratios
(`_dpo_family.py`) and of its hyperparameters. DPO and its label-smoothed (cDPO), robust
(rDPO) and length-normalised (LN-DPO) forms keep the logistic link; IPO, the hinge (SLiC),
EXO and DiscoPOP replace it.
"""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Real

from tunelib import _deprecation
from tunelib import _validation as v
from tunelib._typing import Mask, Scalar
from tunelib.losses._dpo_family import on_margin, pair_logps, with_pair_arguments


def smoothed_logistic(logits: jax.Array, label_smoothing: ArrayLike) -> jax.Array:
    r"""$-(1 - \varepsilon) \log \sigma(x) - \varepsilon \log \sigma(-x)$, computed stably.

    The logistic loss against labels flipped with probability $\varepsilon$ (cDPO's), shared
    by the losses that keep DPO's link (here, AOT, SimPO and CPO).
    """
    eps = jnp.asarray(label_smoothing, logits.dtype)
    return -(1 - eps) * jax.nn.log_sigmoid(logits) - eps * jax.nn.log_sigmoid(-logits)


# Losses on the margin h with DPO's logistic link.


@with_pair_arguments
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
      beta: $\beta > 0$, the weight of the implicit KL penalty; may be traced.
      label_smoothing: $\varepsilon \in [0, 1]$, the assumed label-flip rate; may be traced.

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
    pair = chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps
    return on_margin(_dpo, pair, where, beta=beta, label_smoothing=label_smoothing)


def _dpo(h: jax.Array, *, beta: jax.Array, label_smoothing: jax.Array) -> jax.Array:
    r"""DPO's link: the logistic loss of $\beta h$, label-smoothed."""
    return smoothed_logistic(beta * h, label_smoothing)


@with_pair_arguments
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
      beta: $\beta > 0$; may be traced.
      label_smoothing: $\varepsilon \in [0, 0.5)$, the estimated flip rate of the labels. The
        default 0.1 is our choice of a moderate noise level (the paper and TRL leave it to
        the user); $\varepsilon = 0$ gives DPO. May be traced.

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
    pair = chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps
    return on_margin(_robust_dpo, pair, where, beta=beta, label_smoothing=label_smoothing)


def _robust_dpo(h: jax.Array, *, beta: jax.Array, label_smoothing: jax.Array) -> jax.Array:
    r"""rDPO's link: the logistic losses of $\pm\beta h$, debiased for the flip rate."""
    logits, eps = beta * h, label_smoothing
    return (-(1 - eps) * jax.nn.log_sigmoid(logits) + eps * jax.nn.log_sigmoid(-logits)) / (
        1 - 2 * eps
    )


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


@with_pair_arguments
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
      chosen_lengths: `[B]` token counts of the chosen completions, integer or float. A count
        below 1 (an empty completion, whose sum is 0) is treated as 1, as `sequence_mean`
        does, so the result stays finite.
      rejected_lengths: `[B]` token counts of the rejected completions.
      beta: $\beta > 0$. The default 5 is Tulu 3's value: averaged log-probs are about
        $|y|$ times smaller than sums, so $\beta$ must be about that much larger than DPO's
        0.1. May be traced.

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
    (chosen, rejected, ref_chosen, ref_rejected), where = pair_logps(
        (chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps), where
    )
    dtype = chosen.dtype
    chosen_counts = _token_counts(chosen_lengths, "chosen_lengths", where, dtype)
    rejected_counts = _token_counts(rejected_lengths, "rejected_lengths", where, dtype)
    h = (chosen - ref_chosen) / chosen_counts - (rejected - ref_rejected) / rejected_counts
    loss = -jax.nn.log_sigmoid(jnp.asarray(beta, dtype) * h)
    return jnp.where(where, loss, 0.0)


# Losses that replace the logistic link by another function of the margin.


@with_pair_arguments
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
      beta: $\beta > 0$ (TRL's default 0.1 puts the target margin at 5); may be traced.

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
    pair = chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps
    return on_margin(_ipo, pair, where, beta=beta)


def _ipo(h: jax.Array, *, beta: jax.Array) -> jax.Array:
    r"""IPO's link: the squared distance of $h$ to $1/(2\beta)$."""
    return (h - 1 / (2 * beta)) ** 2


@with_pair_arguments
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
      beta: $\beta > 0$, the inverse of the margin $\delta$; may be traced.

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
    pair = chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps
    return on_margin(_hinge, pair, where, beta=beta)


def _hinge(h: jax.Array, *, beta: jax.Array) -> jax.Array:
    r"""The hinge link: $\max(0, 1 - \beta h)$."""
    return jax.nn.relu(1 - beta * h)


@_deprecation.renamed_arguments(epsilon="label_smoothing")
@with_pair_arguments
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
      beta: $\beta > 0$; may be traced.
      label_smoothing: $\varepsilon \in (0, 1)$, the label smoothing that keeps the KL finite;
        the default $10^{-3}$ is the paper's and TRL's. May be traced.

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
    pair = chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps
    return on_margin(_exo, pair, where, beta=beta, label_smoothing=label_smoothing)


def _exo(h: jax.Array, *, beta: jax.Array, label_smoothing: jax.Array) -> jax.Array:
    r"""EXO's link: the KL from $(\sigma(\beta h), \sigma(-\beta h))$ to the labels."""
    logits, eps = beta * h, label_smoothing
    log_win, log_lose = jax.nn.log_sigmoid(logits), jax.nn.log_sigmoid(-logits)
    return jnp.exp(log_win) * (log_win - jnp.log1p(-eps)) + jnp.exp(log_lose) * (
        log_lose - jnp.log(eps)
    )


@with_pair_arguments
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
      beta: $\beta > 0$; the default 0.05 is the paper's (TRL uses its DPO default 0.1).
        May be traced.
      tau: $\tau > 0$, the temperature of the gate; the default 0.05 is the paper's and
        TRL's. May be traced.

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
    pair = chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps
    return on_margin(_discopop, pair, where, beta=beta, tau=tau)


def _discopop(h: jax.Array, *, beta: jax.Array, tau: jax.Array) -> jax.Array:
    r"""DiscoPOP's link: logistic below 0, exponential above, gated at temperature $\tau$."""
    rho = beta * h
    gate_logits = rho / tau
    logistic = jax.nn.sigmoid(-gate_logits) * -jax.nn.log_sigmoid(rho)
    exponential = jnp.exp(jax.nn.log_sigmoid(gate_logits) - rho)
    return logistic + exponential
