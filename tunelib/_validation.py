"""Trace-time argument checks shared by the public functions.

Every check runs on shapes and dtypes only, so it costs nothing inside `jax.jit` and raises
before any computation with a message that names the argument.
"""

import math
import numbers
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


# -----------------------------------------------------------------------------------------------
# Static values and value arrays: real numbers, intervals, ints, token ids, real-valued arrays.
#
# A hyperparameter or a configuration field given as a Python or NumPy number is checked when
# the function runs (or is traced); a traced value (a JAX array) cannot be seen and passes
# the value checks unchecked. Each check raises a `TypeError` for a value of the wrong kind and
# a `ValueError` for one out of range, with a message that names the argument and the value.


def is_real_number(x: object) -> bool:
    """A Python or NumPy real number (not a bool, not an array); a traced value is not."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def is_int(x: object) -> bool:
    """A Python or NumPy integer (not a bool)."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def real_number(x: object, name: str) -> None:
    """Reject anything but a Python or NumPy real number (a `TypeError` naming `name`)."""
    if not is_real_number(x):
        raise TypeError(f"{name} must be a real number, got {x!r} of type {type(x).__name__}.")


def static_int(x: object, name: str, *, what: str = "an int") -> None:
    """Reject anything but a Python or NumPy integer; `what` describes the value expected."""
    if not is_int(x):
        raise TypeError(f"{name} must be {what}, got {x!r} of type {type(x).__name__}.")


def number_in(
    x: object,
    name: str,
    *,
    low: float | int | None = None,
    high: float | int | None = None,
    low_open: bool = False,
    high_open: bool = False,
    explain: str = "",
    hint: str = "",
) -> None:
    """Reject a Python or NumPy number outside the interval from `low` to `high`.

    A bound that is None is no bound; an open end excludes the bound itself. NaN lies in no
    interval. Anything that is not such a number (a traced value) passes: combine with
    `real_number` where a number is required. The message reads "`name` must lie in (low,
    high], got x." (or "must be >= low", "must be < high" for one bound), with `explain` in
    parentheses after the bound and `hint` after the value.

    Examples:
      >>> number_in(1.5, "top_p", low=0, high=1, low_open=True, hint="1 keeps every token")
      Traceback (most recent call last):
      ...
      ValueError: top_p must lie in (0, 1], got 1.5; 1 keeps every token.
    """
    if not is_real_number(x):
        return
    above = low is None or (low < x if low_open else low <= x)
    below = high is None or (x < high if high_open else x <= high)
    if above and below:
        return
    if low is not None and high is not None:
        bound = f"lie in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    elif low is not None:
        bound = f"be {'>' if low_open else '>='} {low}"
    else:
        bound = f"be {'<' if high_open else '<='} {high}"
    explain = f" ({explain})" if explain else ""
    hint = f"; {hint}" if hint else ""
    raise ValueError(f"{name} must {bound}{explain}, got {x}{hint}.")


def finite_number(x: object, name: str) -> None:
    """Reject a Python or NumPy number that is infinite or NaN; traced values pass."""
    if is_real_number(x) and not math.isfinite(x):
        raise ValueError(f"{name} must be finite, got {x}.")


def token_ids(ids: object, name: str, *, vocab_size: int | None = None) -> tuple[int, ...]:
    """`ids`, a sequence of int token ids, as a tuple of Python ints.

    Every id must be >= 0, and below `vocab_size` when it is given (where the vocabulary is
    known). A string, a single int or an array is a `TypeError`; repeats are allowed.
    """
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise TypeError(f"{name} must be a tuple of int token ids, got {ids!r}.")
    for token in ids:
        if not is_int(token):
            raise TypeError(
                f"{name} must hold int token ids, got {token!r} of type {type(token).__name__} "
                f"in {name}={tuple(ids)!r}."
            )
        if vocab_size is None and token < 0:
            raise ValueError(f"{name} holds token id {token}; token ids are >= 0.")
        if vocab_size is not None and not 0 <= token < vocab_size:
            raise ValueError(
                f"{name} holds token id {token}, outside [0, {vocab_size}) for a vocabulary of "
                f"{vocab_size} tokens."
            )
    return tuple(int(token) for token in ids)


def check_ddof(ddof: object, name: str = "ddof") -> None:
    """Accept the delta degrees of freedom of a variance: 0 (population) or 1 (Bessel)."""
    if isinstance(ddof, bool) or ddof not in (0, 1):
        raise ValueError(f"{name} must be 0 or 1, got {ddof!r}.")


def real_array(x: ArrayLike, name: str) -> jax.Array:
    """`x` as an integer or floating-point array; a `TypeError` naming `name` otherwise."""
    x = jnp.asarray(x)
    if not (jnp.issubdtype(x.dtype, jnp.integer) or jnp.issubdtype(x.dtype, jnp.floating)):
        raise TypeError(
            f"{name} must be an integer or floating-point array, got dtype {x.dtype}; "
            f"convert a boolean array with `{name}.astype(float)`."
        )
    return x


def finite_entries(x: ArrayLike, where: ArrayLike | None, name: str) -> tuple[jax.Array, jax.Array]:
    """Real values in the compute dtype, 0 where they do not count, and the mask of those that do.

    An entry counts when `where` (boolean or integer 0/1, checked against the shape of `x`;
    None = every entry) keeps it and its value is finite: NaN or infinite marks a value that
    could not be measured (a reward that could not be scored). Integer values are cast to
    float, never truncated.
    """
    x = real_array(x, name)
    where = mask_array(where, x.shape)
    x = x.astype(compute_dtype(x.dtype))
    valid = where & jnp.isfinite(x)
    return jnp.where(valid, x, 0.0), valid
