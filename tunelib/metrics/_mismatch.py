"""How far the trainer's policy is from the sampler's: mismatch KL and effective sample size.

The rollout engine reports the log-probs of the tokens it drew; the trainer recomputes them.
In exact arithmetic on the same weights they agree; kernels, precisions, batch shapes and MoE
routing make them differ, and importance weights then correct an update that is silently
off-policy. These diagnostics say by how much.
"""

from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _validation as v
from tunelib._numerics import exp_minus_one_minus
from tunelib._typing import Mask, Scalar
from tunelib.metrics._summary import masked_extremes, masked_mean

Estimator = Literal["k1", "k3"]
ESTIMATORS: tuple[str, ...] = Estimator.__args__


class MismatchKL(NamedTuple):
    """Per-token estimates of $\\mathrm{KL}(\\pi_{\\mathrm{sampler}} \\| \\pi_{\\mathrm{trainer}})$
    and their mean and maximum over the valid tokens.

    Attributes:
      per_token: `[B, T]` estimates, 0 where masked.
      mean: their mean over the valid tokens (0 when none).
      max: their maximum over the valid tokens (0 when none).
    """

    per_token: jax.Array
    mean: jax.Array
    max: jax.Array


def mismatch_kl(
    token_logps: Float[ArrayLike, "B T"],
    sampler_token_logps: Float[ArrayLike, "B T"],
    *,
    estimator: Estimator = "k3",
    log_ratio_clamp: Scalar = 20.0,
    where: Mask[ArrayLike, "B T"] | None = None,
) -> MismatchKL:
    r"""Per-token KL of the sampler's policy from the trainer's, on the tokens the sampler drew.

    $$
    k_1 = -\log r_t, \qquad k_3 = (r_t - 1) - \log r_t, \qquad
    \log r_t = \log \pi_{\mathrm{trainer}}(y_t) - \log \pi_{\mathrm{sampler}}(y_t)
    $$

    with $\log \pi_{\mathrm{trainer}}$ = `token_logps` (the trainer's recomputation) and
    $\log \pi_{\mathrm{sampler}}$ = `sampler_token_logps` (what the rollout engine reported).
    The sampler is the behaviour policy that drew $y_t$, so both are unbiased estimates of
    $\mathrm{KL}(\pi_{\mathrm{sampler}} \| \pi_{\mathrm{trainer}})$ at that position, the
    direction of `approx_kl` with the sampler as the old policy. $k_3$ (default) is never
    negative and has low variance; $k_1$ can be negative on a token. $r_t$ is the importance
    weight that truncated importance sampling (`losses.truncated_importance_weights`) caps.

    $k_3$ is computed without cancellation ($e^x - 1 - x$ by its series for $|x| < 1/2$), so
    it is accurate to the dtype's precision at the log-ratios of $10^{-6}$ that a sampler and
    a trainer in float32 reach; there `expm1(x) - x` would be all rounding error. The
    log-ratio is clamped to $\pm$`log_ratio_clamp` inside $k_3$ so that $r_t$ is finite.

    Args:
      token_logps: `[B, T]` the trainer's log-probs of the sampled tokens.
      sampler_token_logps: `[B, T]` the sampler's log-probs of the same tokens.
      estimator: ``"k3"`` (default) or ``"k1"`` (static).
      log_ratio_clamp: bound on the log-ratio inside $k_3$; may be traced.
      where: `[B, T]` mask, True (or 1) = counts; NaN or infinite values under it are ignored.

    Returns:
      `MismatchKL(per_token, mean, max)`: the `[B, T]` estimates (0 where masked) and their
      mean and maximum over the valid tokens, float32 (float64 for float64 input); the mean
      and maximum are 0 when no token is valid.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import mismatch_kl
      >>> trainer = jnp.log(jnp.array([[0.5, 0.9, 0.2]]))
      >>> sampler = jnp.log(jnp.array([[0.5, 0.8, 0.25]]))
      >>> kl = mismatch_kl(trainer, sampler, where=jnp.array([[True, True, True]]))
      >>> print(kl.per_token.round(5), kl.mean.round(5), kl.max.round(5))
      [[0.      0.00722 0.02314]] 0.01012 0.02314
      >>> print(mismatch_kl(trainer, sampler, estimator="k1").mean.round(5))
      0.03512

    References:
      Yao et al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training",
      2025, https://fengyao.notion.site/off-policy-rl (the mismatch and truncated importance
      sampling).
      Schulman, "Approximating KL Divergence", 2020, http://joschu.net/blog/kl-approx.html.
    """
    v.one_of(estimator, "estimator", ESTIMATORS)
    v.positive_scalar(log_ratio_clamp, "log_ratio_clamp")
    (logps, sampler), where = v.masked_floats(
        where, ndim=2, token_logps=token_logps, sampler_token_logps=sampler_token_logps
    )
    log_ratio = logps - sampler
    if estimator == "k1":
        per_token = -log_ratio
    else:
        clamp = jnp.asarray(log_ratio_clamp, log_ratio.dtype)
        per_token = exp_minus_one_minus(jnp.clip(log_ratio, -clamp, clamp))
    per_token = jnp.where(where, per_token, 0.0)
    _, high = masked_extremes(per_token, where)
    return MismatchKL(per_token=per_token, mean=masked_mean(per_token, where), max=high)


def effective_sample_size(
    log_weights: Float[ArrayLike, " B"] | Float[ArrayLike, "B T"],
    *,
    where: Mask[ArrayLike, " B"] | Mask[ArrayLike, "B T"] | None = None,
) -> Float[Array, ""]:
    r"""The effective sample size of importance weights, as a fraction of their number.

    $$
    \frac{\mathrm{ESS}}{N} = \frac{1}{N} \frac{\big(\sum_i w_i\big)^2}{\sum_i w_i^2}
    = \frac{1}{N} \exp\!\Big(2 \operatorname{LSE}_i \log w_i
    - \operatorname{LSE}_i 2 \log w_i\Big)
    $$

    over the $N$ valid entries of $\log w$ = `log_weights` (per token, `[B, T]`, or per
    sequence, `[B]`), e.g. `token_logps - sampler_token_logps`. It lies in $(0, 1]$: 1 when
    every weight is equal (on-policy data), $1 / N$ when one weight dominates; the weighted
    estimate is about as precise as an unweighted one from $\mathrm{ESS}$ samples. It is
    computed from the log-weights shifted by their maximum, so weights of $e^{\pm 1000}$ do
    not overflow, and it does not depend on the weights' scale. A log-weight of $-\infty$ (a
    weight of 0) counts as an entry; 0 is returned when no entry is valid or every valid
    weight is 0.

    Args:
      log_weights: `[B]` or `[B, T]` log importance weights.
      where: mask of the shape of `log_weights`, True (or 1) = counts; NaN or infinite values
        under a False entry are ignored.

    Returns:
      A float32 scalar in $[0, 1]$ (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.metrics import effective_sample_size
      >>> print(effective_sample_size(jnp.zeros((2, 3))))
      1.0
      >>> print(effective_sample_size(jnp.log(jnp.array([1.0, 1.0, 2.0]))).round(4))  # 16/18
      0.8889
      >>> print(effective_sample_size(jnp.array([1000.0, 0.0, 0.0])).round(4))  # 1/N
      0.3333

    References:
      Kong, "A Note on Importance Sampling using Standardized Weights", technical report 348,
      Department of Statistics, University of Chicago, 1992.
      Owen, "Monte Carlo theory, methods and examples", 2013, chapter 9 (importance
      sampling), https://artowen.su.domains/mc/.
    """
    log_weights = v.float_array(log_weights, "log_weights")
    if log_weights.ndim not in (1, 2):
        raise ValueError(
            f"log_weights must have shape [B] or [B, T], got shape {tuple(log_weights.shape)}."
        )
    (log_weights,), where = v.masked_floats(where, ndim=log_weights.ndim, log_weights=log_weights)
    _, top = masked_extremes(log_weights, where)
    top = jax.lax.stop_gradient(jnp.where(jnp.isfinite(top), top, 0.0))
    weights = jnp.where(where, jnp.exp(log_weights - top), 0.0)
    total, squares = jnp.sum(weights), jnp.sum(weights * weights)
    count = jnp.sum(where).astype(weights.dtype)
    some = squares > 0
    return jnp.where(some, total * total / jnp.where(some, squares, 1.0), 0.0) / jnp.maximum(
        count, 1.0
    )
