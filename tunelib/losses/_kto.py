"""Kahneman-Tversky optimisation (KTO): preference learning from unpaired binary feedback."""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar


def kto_reference_point(
    kl_logps: Float[ArrayLike, " B"],
    ref_kl_logps: Float[ArrayLike, " B"],
    *,
    where: Mask[ArrayLike, " B"] | None = None,
) -> Float[Array, ""]:
    r"""KTO's reference point: a batch estimate of the policy's KL from the reference.

    $$
    \hat z_0 = \max\!\Big(0,\; \frac{1}{m} \sum_{i=1}^{m}
        \log \frac{\pi_\theta(y'_i \mid x_i)}{\pi_{\mathrm{ref}}(y'_i \mid x_i)}\Big)
    $$

    with $\log \pi_\theta(y'_i \mid x_i)$ = `kl_logps`, $\log \pi_{\mathrm{ref}}(y'_i \mid
    x_i)$ = `ref_kl_logps` and $m$ the number of valid rows. As in the paper, $y'_i$ is a
    completion of another prompt in the batch (mismatched pairs, e.g. the completion of row
    $i + 1$ scored after prompt $i$). The result is wrapped in `jax.lax.stop_gradient`: no
    gradient flows through it. Under data parallelism, compute it over the global batch (a
    `jit` over sharded inputs does), as the KL estimate is a batch statistic.

    Args:
      kl_logps: `[B]` policy log-probabilities of the mismatched completions (sums over
        tokens).
      ref_kl_logps: `[B]` reference-policy log-probabilities of the same.
      where: `[B]` mask, True (or 1) = counts. A fully masked batch gives 0.

    Returns:
      A scalar $\hat z_0 \ge 0$, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import kto_reference_point
      >>> print(kto_reference_point(jnp.array([-20.0, -18.0]), jnp.array([-21.0, -18.5])))
      0.75

    References:
      Ethayarajh et al., "KTO: Model Alignment as Prospect Theoretic Optimization", 2024,
      https://arxiv.org/abs/2402.01306.
    """
    (logps, ref_logps), where = v.masked_floats(
        where, ndim=1, kl_logps=kl_logps, ref_kl_logps=ref_kl_logps
    )
    count = jnp.maximum(jnp.sum(where), 1).astype(logps.dtype)
    return jax.lax.stop_gradient(jnp.maximum(jnp.sum(logps - ref_logps) / count, 0.0))


def kto_loss(
    logps: Float[ArrayLike, " B"],
    ref_logps: Float[ArrayLike, " B"],
    desirable: Bool[ArrayLike, " B"],
    *,
    reference_point: Scalar,
    beta: Scalar = 0.1,
    desirable_weight: Scalar = 1.0,
    undesirable_weight: Scalar = 1.0,
    where: Mask[ArrayLike, " B"] | None = None,
) -> Float[Array, " B"]:
    r"""KTO loss for completions each labelled desirable or undesirable.

    $$
    \ell = \begin{cases}
      \lambda_D \big(1 - \sigma(\beta (r - z_0))\big) & y \text{ desirable} \\
      \lambda_U \big(1 - \sigma(\beta (z_0 - r))\big) & y \text{ undesirable}
    \end{cases},
    \qquad r = \log \frac{\pi_\theta(y \mid x)}{\pi_{\mathrm{ref}}(y \mid x)}
    $$

    with $\log \pi_\theta(y \mid x)$ = `logps`, $\log \pi_{\mathrm{ref}}(y \mid x)$ =
    `ref_logps`, the label = `desirable`, the reference point $z_0$ = `reference_point`
    (usually `kto_reference_point`), $\beta$ = `beta`, $\lambda_D$ = `desirable_weight` and
    $\lambda_U$ = `undesirable_weight`. The value $\lambda_y - \ell$ is the prospect-theoretic
    value of the completion; $z_0$ is held constant (`stop_gradient`), as in the paper. For
    imbalanced data the paper recommends weights with
    $\lambda_D n_D / (\lambda_U n_U) \in [1, 4/3]$, where $n_D$ and $n_U$ count the desirable
    and undesirable examples (TRL: `KTOTrainer`, `loss_type="kto"`).

    Args:
      logps: `[B]` policy log-probabilities of the completions (sums over tokens).
      ref_logps: `[B]` reference-policy log-probabilities of the completions.
      desirable: `[B]` boolean, True for a desirable (thumbs-up) completion.
      reference_point: $z_0$, a scalar; may be traced. Required: the paper estimates it per
        batch with `kto_reference_point`; 0 gives the simplified variant without a KL term.
      beta: $\beta > 0$; the default 0.1 is the paper's and TRL's. May be traced.
      desirable_weight: $\lambda_D \ge 0$; may be traced.
      undesirable_weight: $\lambda_U \ge 0$; may be traced.
      where: `[B]` mask, True (or 1) = counts; masked rows give 0 and a zero gradient.

    Returns:
      `[B]` per-completion losses in $[0, \lambda_y]$, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.losses import kto_loss
      >>> logps, ref_logps = jnp.array([-10.0, -12.0]), jnp.array([-12.0, -10.0])
      >>> desirable = jnp.array([True, False])
      >>> loss = kto_loss(logps, ref_logps, desirable, reference_point=0.5, beta=1.0)
      >>> print(loss.round(4).tolist())
      [0.1824, 0.0759]

    References:
      Ethayarajh et al., "KTO: Model Alignment as Prospect Theoretic Optimization", 2024,
      https://arxiv.org/abs/2402.01306.
    """
    v.positive_scalar(beta, "beta")
    (logps, ref_logps), where = v.masked_floats(where, ndim=1, logps=logps, ref_logps=ref_logps)
    desirable = v.bool_array(desirable, "desirable")
    v.check_shape(desirable, "desirable", where.shape, f"logps {where.shape}")
    dtype = logps.dtype
    z = jax.lax.stop_gradient(jnp.asarray(reference_point, dtype))
    scaled = jnp.asarray(beta, dtype) * (logps - ref_logps - z)
    # 1 - sigmoid(x) = sigmoid(-x), exact for large x.
    loss = jnp.where(
        desirable,
        jnp.asarray(desirable_weight, dtype) * jax.nn.sigmoid(-scaled),
        jnp.asarray(undesirable_weight, dtype) * jax.nn.sigmoid(scaled),
    )
    return jnp.where(where, loss, 0.0)
