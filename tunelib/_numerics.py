"""Elementary functions computed without cancellation, shared by the losses and the metrics."""

import jax
import jax.numpy as jnp

# Below this |x| the k3 term e^x - 1 - x comes from its Taylor series: the direct difference
# loses digits to cancellation near 0, where the value is ~x^2 / 2.
_SERIES_RADIUS = 0.5


def exp_minus_one_minus(x: jax.Array) -> jax.Array:
    r"""$e^x - 1 - x$, from $x^2 \sum_{k \ge 2} x^{k-2} / k!$ for $|x| < 0.5$ (10 terms in
    float32, 16 in float64: truncation below the unit roundoff) and directly elsewhere.

    The k3 estimator of KL, $r - 1 - \log r$ with $\log r = x$, is this function: at the
    log-ratios near $10^{-6}$ of a sampler and a trainer in float32, `expm1(x) - x` would be
    rounding error alone."""
    small = jnp.abs(x) < _SERIES_RADIUS
    xs = jnp.where(small, x, 0.0)
    n_terms = 16 if x.dtype == jnp.float64 else 10
    factorials = [1.0]
    for k in range(1, n_terms + 2):
        factorials.append(factorials[-1] * k)
    acc = jnp.full_like(xs, 1.0 / factorials[n_terms + 1])
    for k in range(n_terms, 1, -1):
        acc = 1.0 / factorials[k] + xs * acc
    return jnp.where(small, xs * xs * acc, jnp.expm1(x) - x)
