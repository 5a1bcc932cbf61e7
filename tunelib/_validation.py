"""Trace-time argument checks shared by the public functions.

Every check runs on shapes and dtypes only, so it costs nothing inside `jax.jit` and raises
before any computation with a message that names the argument.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike


def compute_dtype(*dtypes: jnp.dtype) -> jnp.dtype:
    """The dtype numerics run in: at least float32, float64 when an input is float64."""
    return jnp.result_type(jnp.float32, *dtypes)


def float_array(x: ArrayLike, name: str) -> jax.Array:
    """`x` as a floating-point array; a `TypeError` naming `name` for any other dtype."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype}.")
    return x


def int_array(x: ArrayLike, name: str) -> jax.Array:
    """`x` as an integer array; a `TypeError` naming `name` for any other dtype."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {x.dtype}.")
    return x


def bool_array(x: ArrayLike, name: str) -> jax.Array:
    """`x` as a boolean array; a `TypeError` naming `name` for any other dtype."""
    x = jnp.asarray(x)
    if x.dtype != jnp.bool_:
        raise TypeError(
            f"{name} must be a boolean array (True = counts), got dtype {x.dtype}; "
            f"convert an integer mask with `{name}.astype(bool)`."
        )
    return x


def mask_like(x: ArrayLike, name: str) -> jax.Array:
    """A mask as a boolean array: booleans as they are, integer 0/1 converted (1 = counts).

    Integer masks are what TRL and Tunix pass (`attention_mask`, `completion_mask`). A
    concrete integer mask holding any value but 0 and 1 is a `ValueError`; a traced one cannot
    be inspected, and there every nonzero value counts. Any other dtype is a `TypeError`.
    """
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        return x
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(
            f"{name} must be a boolean mask (True = counts) or an integer mask of 0 and 1, "
            f"got dtype {x.dtype}."
        )
    if not isinstance(x, jax.core.Tracer):
        values = np.unique(np.asarray(x))
        bad = values[(values != 0) & (values != 1)]
        if bad.size:
            raise ValueError(
                f"{name} is an integer mask, so it must hold only 0 and 1, got {bad[0]}."
            )
    return x != 0


def check_ndim(x: jax.Array, name: str, *, at_least: int) -> None:
    if x.ndim < at_least:
        raise ValueError(f"{name} must have at least {at_least} dimensions, got shape {x.shape}.")


def check_shape(x: jax.Array, name: str, shape: Sequence[int], like: str) -> None:
    """Raise a `ValueError` unless `x.shape == shape`; `like` names what `shape` comes from."""
    if tuple(x.shape) != tuple(shape):
        raise ValueError(
            f"{name} has shape {tuple(x.shape)} but must have shape {tuple(shape)} to match "
            f"{like}; tunelib never broadcasts between data arrays."
        )


def same_shape(**arrays: jax.Array) -> tuple[int, ...]:
    """Check that all named arrays share one shape and return it."""
    (first_name, first), *rest = arrays.items()
    for name, x in rest:
        check_shape(x, name, first.shape, f"{first_name} {tuple(first.shape)}")
    return tuple(first.shape)


def mask_array(where: ArrayLike | None, shape: Sequence[int], name: str = "where") -> jax.Array:
    """The mask `where` (boolean, or integer 0/1) as booleans checked against `shape`; all
    True when `where` is None."""
    if where is None:
        return jnp.ones(shape, dtype=jnp.bool_)
    where = mask_like(where, name)
    check_shape(where, name, shape, "the data it masks")
    return where


def positive_scalar(x: ArrayLike, name: str) -> None:
    """Reject a non-positive Python or concrete number; traced values pass unchecked."""
    if isinstance(x, int | float) and not x > 0:
        raise ValueError(f"{name} must be > 0, got {x}.")


def non_negative(x: ArrayLike, name: str) -> None:
    """Reject a negative Python number; traced values pass unchecked."""
    if isinstance(x, int | float) and not x >= 0:
        raise ValueError(f"{name} must be >= 0, got {x}.")


def greater_than_one(x: ArrayLike, name: str) -> None:
    """Reject a Python number that is not > 1; traced values pass unchecked."""
    if isinstance(x, int | float) and not x > 1:
        raise ValueError(f"{name} must be > 1, got {x}.")


def one_of(value: str, name: str, allowed: Sequence[str]) -> None:
    """Reject a static option that is not among `allowed`, listing them."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}.")


def unit_interval(x: ArrayLike, name: str, *, closed: bool = True) -> None:
    """Reject a Python number outside [0, 1] (or (0, 1) when `closed` is False)."""
    if isinstance(x, int | float):
        ok = 0.0 <= x <= 1.0 if closed else 0.0 < x < 1.0
        if not ok:
            interval = "[0, 1]" if closed else "(0, 1)"
            raise ValueError(f"{name} must lie in {interval}, got {x}.")
