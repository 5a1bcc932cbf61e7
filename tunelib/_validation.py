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
    """Reject a non-positive Python or NumPy number; traced values pass unchecked."""
    number_in(x, name, low=0, low_open=True)


def non_negative(x: ArrayLike, name: str) -> None:
    """Reject a negative Python or NumPy number; traced values pass unchecked."""
    number_in(x, name, low=0)


def greater_than_one(x: ArrayLike, name: str) -> None:
    """Reject a Python or NumPy number that is not > 1; traced values pass unchecked."""
    number_in(x, name, low=1, low_open=True)


def one_of(value: str, name: str, allowed: Sequence[str]) -> None:
    """Reject a static option that is not among `allowed`, listing them."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {tuple(allowed)}, got {value!r}.")


def unit_interval(x: ArrayLike, name: str, *, closed: bool = True) -> None:
    """Reject a Python or NumPy number outside [0, 1] (or (0, 1) when `closed` is False)."""
    number_in(x, name, low=0, high=1, low_open=not closed, high_open=not closed)


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


def token_id_tuple(ids: object, name: str, *, vocab_size: int | None = None) -> tuple[int, ...]:
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


def softcap(x: object, name: str = "softcap") -> float | None:
    """A soft-cap `c` as a Python float, or None; an error naming `name` unless it is a
    finite number > 0."""
    if x is None:
        return None
    real_number(x, name)
    finite_number(x, name)
    if x <= 0:
        raise ValueError(f"{name} must be > 0 or None, got {x}.")
    return float(x)


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


def reward_vectors(
    rewards: jax.Array, where: jax.Array, reward_weights: ArrayLike | None
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Several rewards per completion, ready to combine: `(rewards, weights, rows, entries)`.

    `rewards` is a checked real array `[..., K]` and `where` the checked `[...]` mask of its
    completions. A completion counts (`rows`, `[...]`) when `where` keeps it and at least one
    of its rewards is finite; a reward counts (`entries`, `[..., K]`) when it is finite in a
    completion that counts. The rewards come back in the compute dtype, 0 where they do not
    count, with the `[K]` weights in that dtype: `reward_weights` checked against $K$, or
    every reward weighing 1 when it is None.
    """
    dtype = compute_dtype(rewards.dtype)
    rewards = rewards.astype(dtype)
    finite = jnp.isfinite(rewards)
    rows = where & jnp.any(finite, axis=-1)
    entries = rows[..., None] & finite
    rewards = jnp.where(entries, rewards, 0.0)
    num_rewards = rewards.shape[-1]
    if reward_weights is None:
        return rewards, jnp.ones((num_rewards,), dtype), rows, entries
    weights = real_array(reward_weights, "reward_weights")
    check_shape(weights, "reward_weights", (num_rewards,), f"rewards {rewards.shape}")
    return rewards, weights.astype(dtype), rows, entries


# ---------------------------------------------------------------------------------------------
# The data arrays of the log-probs, losses and metrics: masked float arrays of one shape,
# advantages, behaviour log-probs, token and segment ids; ranges of hyperparameters.

# How an error message writes the shape a function expects, by number of dimensions.
_SHAPE_NAMES = {1: "[B]", 2: "[B, T]"}


def masked_floats(
    where: ArrayLike | None, *, ndim: int, **arrays: ArrayLike
) -> tuple[list[jax.Array], jax.Array]:
    """The named arrays as floats of one shape with `ndim` dimensions, in the compute dtype,
    zero where masked.

    `ndim` is 1 for per-sequence data `[B]` and 2 for per-token data `[B, T]`. Returns the
    arrays in argument order and the boolean mask (all True when `where` is None). Zeroing
    masked entries before any arithmetic keeps NaN or infinite values there out of both the
    value and the gradient.
    """
    checked = {name: float_array(x, name) for name, x in arrays.items()}
    for name, x in checked.items():
        if x.ndim != ndim:
            raise ValueError(
                f"{name} must have shape {_SHAPE_NAMES[ndim]}, got shape {tuple(x.shape)}."
            )
    shape = same_shape(**checked)
    where = mask_array(where, shape)
    dtype = compute_dtype(*(x.dtype for x in checked.values()))
    return [jnp.where(where, x.astype(dtype), 0.0) for x in checked.values()], where


def advantages_array(advantages: ArrayLike, where: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """`[B]` (one per sequence) or `[B, T]` (one per token) advantages as `[B, T]`, 0 if masked.

    `where` is the checked `[B, T]` mask; the result is in the compute dtype of `dtype` and
    the advantages' own dtype.
    """
    advantages = float_array(advantages, "advantages")
    b, t = where.shape
    if advantages.shape == (b,):
        advantages = jnp.broadcast_to(advantages[:, None], (b, t))
    elif advantages.shape != (b, t):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)} but must have shape ({b},) (one "
            f"per sequence) or ({b}, {t}) (one per token) to match token_logps ({b}, {t}); "
            "tunelib never broadcasts between data arrays."
        )
    dtype = compute_dtype(dtype, advantages.dtype)
    return jnp.where(where, advantages.astype(dtype), 0.0)


def behaviour_logps(
    token_logps: ArrayLike, old_token_logps: ArrayLike | None, where: ArrayLike | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Checked `[B, T]` log-probs, behaviour log-probs and the mask.

    The behaviour log-probs are `stop_gradient(token_logps)` when `old_token_logps` is None
    (on-policy data: a ratio of 1 whose gradient is that of the log-probs).
    """
    if old_token_logps is None:
        (logps,), where = masked_floats(where, ndim=2, token_logps=token_logps)
        return logps, jax.lax.stop_gradient(logps), where
    (logps, old), where = masked_floats(
        where, ndim=2, token_logps=token_logps, old_token_logps=old_token_logps
    )
    return logps, old, where


def static_count(x: int, name: str) -> None:
    """Reject a static size (a chunk width, a number of segments) that is not an int >= 1."""
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"{name} must be a Python integer >= 1 (static), got {x!r}.")


def _concrete(*arrays: jax.Array) -> bool:
    return not any(isinstance(x, jax.core.Tracer) for x in arrays)


def token_id_array(
    ids: ArrayLike, vocab: int, where: jax.Array, name: str = "targets"
) -> tuple[jax.Array, jax.Array]:
    """Integer token ids checked against a vocabulary of `vocab` entries.

    Returns the ids with 0 wherever they are masked or outside `[0, vocab)` (safe to gather
    with) and a boolean array, True where the id lies in `[0, vocab)`. A concrete id outside
    that range at a counted position (`where` broadcasts against `ids`) is a `ValueError`
    naming `name`, the id and V; masked positions may hold anything (an ignore index of
    -100). Traced ids cannot be inspected: the caller gives their positions a NaN result.
    """
    ids = int_array(ids, name)
    inside = (ids >= 0) & (ids < vocab)
    if _concrete(ids, where):
        values = np.asarray(ids)
        counted = np.broadcast_to(np.asarray(where), values.shape)
        bad = values[counted & ((values < 0) | (values >= vocab))]
        if bad.size:
            raise ValueError(
                f"{name} holds the token id {bad[0]} at a counted position, outside [0, V) for "
                f"V = {vocab}; fix the id or mask the position out with `where`."
            )
    return jnp.where(where & inside, ids, 0), inside


def segment_ids_array(
    segment_ids: ArrayLike,
    shape: Sequence[int],
    *,
    where: jax.Array,
    num_segments: int | None = None,
    name: str = "segment_ids",
) -> jax.Array:
    """Packed-sequence ids `[..., T]` (1, 2, ... per sequence of a row, 0 on padding), checked.

    A concrete id below 0, or above `num_segments` when given, at a counted position is a
    `ValueError` naming `name`; traced ids pass unchecked, and an id outside `[1, S]` then
    belongs to no segment.
    """
    segment_ids = int_array(segment_ids, name)
    check_shape(segment_ids, name, shape, "the data it segments")
    if _concrete(segment_ids, where):
        values = np.asarray(segment_ids)[np.broadcast_to(np.asarray(where), tuple(shape))]
        high = np.inf if num_segments is None else num_segments
        bad = values[(values < 0) | (values > high)]
        if bad.size:
            limit = "0" if num_segments is None else f"0 and num_segments = {num_segments}"
            raise ValueError(
                f"{name} holds {bad[0]} at a counted position; segment ids lie between {limit} "
                "(1, 2, ... per sequence of a row, 0 on padding)."
            )
    return segment_ids


def sample_count(k: object, where: jax.Array, *, per_row: bool) -> None:
    """Accept `k`, the static number of samples a statistic of `[B, n]` samples draws on.

    `k` must be a Python int in `[1, n]`. With `per_row`, a concrete `where` must also keep at
    least `k` samples in every row that keeps any (a row that keeps none is padding); a traced
    `where` cannot be inspected.
    """
    n = where.shape[-1]
    static_int(k, "k", what="a Python int >= 1 (a static value)")
    number_in(k, "k", low=1, high=n, explain=f"the samples per prompt, n = {n}")
    if per_row and _concrete(where):
        counts = np.asarray(where).sum(axis=-1)
        short = np.flatnonzero((counts > 0) & (counts < k))
        if short.size:
            row = short[0]
            raise ValueError(
                f"k = {k} is larger than the {counts[row]} samples `where` keeps in row {row}; "
                "draw at least k samples per prompt or lower k."
            )
