"""Masked moments and whitening: mean 0 and variance 1 over the valid entries."""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar


def masked_moments(
    x: jax.Array, where: jax.Array, *, axis: int | None, ddof: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Mean, variance and count of the entries of `x` where `where` is True, along `axis`.

    Reduced axes are kept (size 1). Entries outside `where` may hold anything, NaN included.
    The variance divides by `count - ddof` and is 0 when `count <= ddof`; the mean of no entry
    is 0.
    """
    count = jnp.sum(where, axis=axis, keepdims=True)
    x = jnp.where(where, x, 0.0)
    mean = jnp.sum(x, axis=axis, keepdims=True) / jnp.maximum(count, 1).astype(x.dtype)
    centered = jnp.where(where, x - mean, 0.0)
    dof = count - ddof
    var = jnp.sum(centered**2, axis=axis, keepdims=True) / jnp.maximum(dof, 1).astype(x.dtype)
    return mean, jnp.where(dof > 0, var, 0.0), count


def whiten(
    values: Float[ArrayLike, "*B"],
    *,
    ddof: int = 1,
    shift_mean: bool = True,
    eps: Scalar = 1e-8,
    where: Mask[ArrayLike, "*B"] | None = None,
) -> Float[Array, "*B"]:
    r"""Whiten values over all valid entries: subtract the mean, divide by the std.

    $$
    \hat{x}_i = \frac{x_i - \mu}{\sqrt{\sigma^2 + \epsilon}}, \qquad
    \mu = \frac{1}{n} \sum_{i : m_i} x_i, \qquad
    \sigma^2 = \frac{1}{n - d} \sum_{i : m_i} (x_i - \mu)^2
    $$

    with $x$ = `values`, $m$ = `where`, $n$ the number of valid entries, $d$ = `ddof` and
    $\epsilon$ = `eps`. With `shift_mean=False` the mean is added back,
    $\hat{x}_i + \mu$: the values are rescaled to unit variance but keep their mean. The
    statistics run over every valid entry of the array together, whatever its shape.

    REINFORCE++ (Hu 2025) whitens its advantages over the whole global batch: with per-token
    advantages $A$ = the reward-to-go of the KL-shaped token rewards (`discounted_returns`),
    call `whiten(A, where=where)` with the `[B, T]` completion mask, so that every valid token
    of the batch counts once. Its "baseline" variant subtracts the group mean first,
    `whiten(group_advantages(rewards, scale="none"))`, then spreads the result over the
    tokens. Under data parallelism the statistics must be those of the global batch: run
    `whiten` on the gathered (or `jax.jit`-sharded) array, not per device.

    The form $1/\sqrt{\sigma^2 + \epsilon}$ with unbiased variance and $\epsilon = 10^{-8}$
    is the masked whitening of TRL's PPO trainer and of verl (including `shift_mean`); some
    implementations divide by $\sigma + \epsilon$ instead, which differs only when $\sigma$
    is tiny. `group_advantages` divides by $\sigma + \epsilon$, as GRPO does.

    Args:
      values: `[...]` values, typically `[B, T]` per-token or `[B]` per-sequence advantages.
      ddof: 1 (default; Bessel's correction, as TRL and verl) or 0 (population variance).
        With at most `ddof` valid entries the variance is taken as 0.
      shift_mean: True (default) centres the result on 0; False keeps the mean $\mu$.
      eps: $\epsilon \ge 0$, added to the variance; may be traced. With `eps=0` a
        constant input gives 0 (or $\mu$), not NaN.
      where: `[...]` mask (boolean, or integer 0/1), True = counts; None (default) counts
        every entry. Masked entries are left out of the statistics and give exactly 0 with a
        zero gradient, even when NaN or infinite.

    Returns:
      `[...]` whitened values, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.advantages import whiten
      >>> x = jnp.array([1.0, 2.0, 3.0, jnp.nan])
      >>> print(whiten(x, where=jnp.array([True, True, True, False])).round(4))
      [-1.  0.  1.  0.]

    References:
      Hu, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
      Models", 2025, https://arxiv.org/abs/2501.03262.
    """
    values = v.float_array(values, "values")
    where = v.mask_array(where, values.shape)
    v.check_ddof(ddof)
    v.non_negative(eps, "eps")
    dtype = v.compute_dtype(values.dtype)
    x = jnp.where(where, values.astype(dtype), 0.0)
    mean, var, _ = masked_moments(x, where, axis=None, ddof=ddof)
    denominator = var + jnp.asarray(eps, dtype)
    positive = denominator > 0
    scale = jnp.where(positive, jax.lax.rsqrt(jnp.where(positive, denominator, 1.0)), 0.0)
    whitened = (x - mean) * scale
    if not shift_mean:
        whitened = whitened + mean
    return jnp.where(where, whitened, 0.0)
