r"""Losses that replace DPO's logistic link by another function of the DPO margin.

IPO regresses the margin onto a target, SLiC's hinge stops at one, EXO minimises a reverse
KL divergence to smoothed labels and DiscoPOP blends the logistic with an exponential loss. Each
takes the same four `[B]` sequence log-probabilities as `dpo_loss` and is a function of

$$
h = \log \frac{\pi_\theta(y_w)}{\pi_{\mathrm{ref}}(y_w)}
  - \log \frac{\pi_\theta(y_l)}{\pi_{\mathrm{ref}}(y_l)}.
$$
"""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float

from tunelib import _validation as v
from tunelib._typing import Scalar
from tunelib.losses._dpo import dpo_margin


def ipo_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    where: Bool[ArrayLike, " B"] | None = None,
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
      where: `[B]` boolean mask, True = counts; masked rows give 0 and a zero gradient.

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
    where: Bool[ArrayLike, " B"] | None = None,
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
      where: `[B]` boolean mask, True = counts; masked rows give 0 and a zero gradient.

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


def exo_loss(
    chosen_logps: Float[ArrayLike, " B"],
    rejected_logps: Float[ArrayLike, " B"],
    ref_chosen_logps: Float[ArrayLike, " B"],
    ref_rejected_logps: Float[ArrayLike, " B"],
    *,
    beta: Scalar = 0.1,
    epsilon: Scalar = 1e-3,
    where: Bool[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""Efficient exact optimisation (EXO) for a pair: reverse KL to smoothed labels.

    $$
    \ell = \sigma(\beta h) \log \frac{\sigma(\beta h)}{1 - \varepsilon}
         + \sigma(-\beta h) \log \frac{\sigma(-\beta h)}{\varepsilon}
    $$

    with $h$ the DPO margin of `chosen_logps`, `rejected_logps`, `ref_chosen_logps` and
    `ref_rejected_logps` (see `dpo_loss`), $\beta$ = `beta` and $\varepsilon$ = `epsilon`.
    $\sigma(\beta h)$ is the model's probability that $y_w$ wins the pair; the loss is the KL
    divergence from that two-point distribution to the labels $(1 - \varepsilon,
    \varepsilon)$. DPO minimises the forward KL between the same distributions; the reverse
    KL is mode-seeking. It is 0 exactly at $\beta h = \log((1 - \varepsilon)/\varepsilon)$ (TRL:
    `loss_type="exo_pair"`, where `label_smoothing` plays $\varepsilon$).

    Args:
      chosen_logps: `[B]` policy log-probabilities of the chosen completions.
      rejected_logps: `[B]` policy log-probabilities of the rejected completions.
      ref_chosen_logps: `[B]` reference-policy log-probabilities of the chosen completions.
      ref_rejected_logps: `[B]` reference-policy log-probabilities of the rejected ones.
      beta: $\beta > 0$; may be traced.
      epsilon: $\varepsilon \in (0, 1)$, the label smoothing that keeps the KL finite; the
        default $10^{-3}$ is the paper's and TRL's. May be traced.
      where: `[B]` boolean mask, True = counts; masked rows give 0 and a zero gradient.

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
    v.unit_interval(epsilon, "epsilon", closed=False)
    h, where = dpo_margin(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, where)
    logits = jnp.asarray(beta, h.dtype) * h
    eps = jnp.asarray(epsilon, h.dtype)
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
    where: Bool[ArrayLike, " B"] | None = None,
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
      where: `[B]` boolean mask, True = counts; masked rows give 0 and a zero gradient.

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
