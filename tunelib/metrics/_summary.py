"""Masked means and extremes shared by the statistics: 0, not NaN or infinity, when empty."""

import jax
import jax.numpy as jnp


def masked_mean(x: jax.Array, where: jax.Array) -> jax.Array:
    """The mean of `x` over the entries where `where` is True; 0 when there is none."""
    count = jnp.sum(where)
    return jnp.sum(jnp.where(where, x, 0.0)) / jnp.maximum(count, 1).astype(x.dtype)


def masked_extremes(x: jax.Array, where: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The minimum and maximum of `x` over the entries where `where` is True; 0 when none."""
    some = jnp.any(where)
    low = jnp.min(jnp.where(where, x, jnp.inf))
    high = jnp.max(jnp.where(where, x, -jnp.inf))
    return jnp.where(some, low, 0.0), jnp.where(some, high, 0.0)
