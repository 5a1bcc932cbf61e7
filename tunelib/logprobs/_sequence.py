"""Masked reductions of per-token values over the token axis."""

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Bool, Float

from tunelib import _validation as v


def _masked(values: ArrayLike, where: ArrayLike | None) -> tuple[jax.Array, jax.Array]:
    values = v.float_array(values, "values")
    v.check_ndim(values, "values", at_least=1)
    where = v.mask_array(where, values.shape)
    values = values.astype(v.compute_dtype(values.dtype))
    return jnp.where(where, values, 0.0), where


def sequence_sum(
    values: Float[ArrayLike, "*B T"], *, where: Bool[ArrayLike, "*B T"] | None = None
) -> Float[Array, "*B"]:
    r"""Masked sum over the last (token) axis: $\sum_t m_t x_t$.

    With `values` = per-token log-probs this is the sequence log-probability
    $\log \pi(y \mid x) = \sum_t \log \pi(y_t \mid x, y_{<t})$ that preference losses take.

    Args:
      values: `[..., T]` per-token values.
      where: `[..., T]` boolean mask $m$, True = counts. Masked entries contribute exactly 0
        to the value and the gradient, even when they are NaN or infinite.

    Returns:
      `[...]` sums, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.logprobs import sequence_sum
      >>> x = jnp.array([[-1.0, -2.0, jnp.nan]])
      >>> print(sequence_sum(x, where=jnp.array([[True, True, False]])))
      [-3.]
    """
    values, _ = _masked(values, where)
    return jnp.sum(values, axis=-1)


def sequence_mean(
    values: Float[ArrayLike, "*B T"], *, where: Bool[ArrayLike, "*B T"] | None = None
) -> Float[Array, "*B"]:
    r"""Masked mean over the last (token) axis: $\sum_t m_t x_t / \sum_t m_t$.

    With per-token log-probs this is the length-normalised sequence log-probability used by
    SimPO, ORPO and length-normalised DPO. A row with no valid token gives 0 (not NaN).

    Args:
      values: `[..., T]` per-token values.
      where: `[..., T]` boolean mask $m$, True = counts.

    Returns:
      `[...]` means, float32 (float64 for float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.logprobs import sequence_mean
      >>> x = jnp.array([[-1.0, -2.0, 5.0], [1.0, 1.0, 1.0]])
      >>> print(sequence_mean(x, where=jnp.array([[True, True, False], [False] * 3])))
      [-1.5  0. ]
    """
    values, where = _masked(values, where)
    count = jnp.sum(where, axis=-1)
    return jnp.sum(values, axis=-1) / jnp.maximum(count, 1).astype(values.dtype)
