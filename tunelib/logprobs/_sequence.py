"""Masked reductions of per-token values over the token axis, per row or per packed segment."""

import math

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from tunelib import _validation as v
from tunelib._typing import Mask


def _masked(values: ArrayLike, where: ArrayLike | None) -> tuple[jax.Array, jax.Array]:
    values = v.float_array(values, "values")
    v.check_ndim(values, "values", at_least=1)
    where = v.mask_array(where, values.shape)
    values = values.astype(v.compute_dtype(values.dtype))
    return jnp.where(where, values, 0.0), where


def _reduce(
    values: jax.Array,
    where: jax.Array,
    segment_ids: ArrayLike | None,
    num_segments: int | None,
) -> tuple[jax.Array, jax.Array]:
    """Sums of the (masked) values and counts of valid tokens, per row `[...]` or, with
    `segment_ids`, per segment `[..., S]`."""
    if segment_ids is None:
        if num_segments is not None:
            raise ValueError(
                f"num_segments applies only with segment_ids; got num_segments={num_segments!r} "
                "and segment_ids=None."
            )
        return jnp.sum(values, axis=-1), jnp.sum(where, axis=-1).astype(values.dtype)
    if num_segments is None:
        raise ValueError(
            "segment_ids needs num_segments, the static number S of segment columns of the "
            "result (at most the number of sequences packed in a row)."
        )
    v.static_count(num_segments, "num_segments")
    segment_ids = v.segment_ids_array(
        segment_ids, values.shape, where=where, num_segments=num_segments
    )
    *lead, length = values.shape
    rows = math.prod(lead)
    total = rows * num_segments
    ids = segment_ids.reshape(rows, length)
    # Segment s of row r goes to column r * S + s - 1; ids outside [1, S] (padding) go past the
    # end, which `segment_sum` drops.
    belongs = (ids >= 1) & (ids <= num_segments)
    flat = jnp.where(belongs, jnp.arange(rows)[:, None] * num_segments + ids - 1, total)
    flat = flat.reshape(-1)
    sums = jax.ops.segment_sum(values.reshape(-1), flat, num_segments=total)
    counts = jax.ops.segment_sum(where.reshape(-1).astype(values.dtype), flat, num_segments=total)
    return sums.reshape(*lead, num_segments), counts.reshape(*lead, num_segments)


def sequence_sum(
    values: Float[ArrayLike, "*B T"],
    *,
    where: Mask[ArrayLike, "*B T"] | None = None,
    segment_ids: Int[ArrayLike, "*B T"] | None = None,
    num_segments: int | None = None,
) -> Float[Array, "*B"] | Float[Array, "*B S"]:
    r"""Masked sum over the last (token) axis, per row or per packed sequence.

    $$
    \sum_t m_t x_t, \qquad \text{or with segments} \qquad
    s_{i,k} = \sum_t m_{i,t}\, [\sigma_{i,t} = k]\, x_{i,t}, \quad k = 1, \dots, S
    $$

    with $x$ = `values`, $m$ = `where`, $\sigma$ = `segment_ids` and $S$ = `num_segments`.
    With per-token log-probs this is the sequence log-probability
    $\log \pi(y \mid x) = \sum_t \log \pi(y_t \mid x, y_{<t})$ that preference losses take.

    A packed row holds several sequences one after another, marked by `segment_ids` 1, 2, ...
    (0 on padding), as `tunelib.data`'s packed pipelines produce them. Column $k - 1$ of the
    result is then the sum over segment $k$ of its row, and a segment that does not occur
    gives 0, so a packed batch gives the same per-sequence values as the padded one.

    Args:
      values: `[..., T]` per-token values.
      where: `[..., T]` mask $m$, True (or 1) = counts. Masked entries contribute exactly 0 to
        the value and the gradient, even when they are NaN or infinite.
      segment_ids: optional `[..., T]` integer segment ids, 1, 2, ... per sequence of a row
        and 0 on padding. Tokens with id 0 belong to no segment. An id below 0 or above
        `num_segments` at a counted position is a `ValueError` when it can be read (outside
        `jax.jit`); under `jit` such a token belongs to no segment.
      num_segments: the static number $S$ of segment columns; required with `segment_ids`
        (at most the number of sequences a row can hold).

    Returns:
      `[...]` sums, or `[..., S]` per-segment sums with `segment_ids`; float32 (float64 for
      float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.logprobs import sequence_sum
      >>> x = jnp.array([[-1.0, -2.0, jnp.nan]])
      >>> print(sequence_sum(x, where=jnp.array([[True, True, False]])))
      [-3.]
      >>> packed = jnp.array([[-1.0, -2.0, -3.0, -4.0, 0.0]])  # two sequences and padding
      >>> segments = jnp.array([[1, 1, 2, 2, 0]])
      >>> print(sequence_sum(packed, segment_ids=segments, num_segments=3))
      [[-3. -7.  0.]]
    """
    values, where = _masked(values, where)
    return _reduce(values, where, segment_ids, num_segments)[0]


def sequence_mean(
    values: Float[ArrayLike, "*B T"],
    *,
    where: Mask[ArrayLike, "*B T"] | None = None,
    segment_ids: Int[ArrayLike, "*B T"] | None = None,
    num_segments: int | None = None,
) -> Float[Array, "*B"] | Float[Array, "*B S"]:
    r"""Masked mean over the last (token) axis, per row or per packed sequence.

    $$
    \frac{\sum_t m_t x_t}{\sum_t m_t}, \qquad \text{or with segments} \qquad
    \frac{\sum_t m_{i,t}\, [\sigma_{i,t} = k]\, x_{i,t}}{\sum_t m_{i,t}\, [\sigma_{i,t} = k]}
    $$

    with $x$ = `values`, $m$ = `where`, $\sigma$ = `segment_ids` (see `sequence_sum`). With
    per-token log-probs this is the length-normalised sequence log-probability used by
    SimPO, ORPO and length-normalised DPO. A row or segment with no valid token gives 0 (not
    NaN).

    Args:
      values: `[..., T]` per-token values.
      where: `[..., T]` mask $m$, True (or 1) = counts.
      segment_ids: optional `[..., T]` integer segment ids, 1, 2, ... per sequence of a row
        and 0 on padding (see `sequence_sum`).
      num_segments: the static number $S$ of segment columns; required with `segment_ids`.

    Returns:
      `[...]` means, or `[..., S]` per-segment means with `segment_ids`; float32 (float64 for
      float64 input).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.logprobs import sequence_mean
      >>> x = jnp.array([[-1.0, -2.0, 5.0], [1.0, 1.0, 1.0]])
      >>> print(sequence_mean(x, where=jnp.array([[True, True, False], [False] * 3])))
      [-1.5  0. ]
      >>> segments = jnp.array([[1, 1, 2], [1, 1, 1]])
      >>> print(sequence_mean(x, segment_ids=segments, num_segments=2))
      [[-1.5  5. ]
       [ 1.   0. ]]
    """
    values, where = _masked(values, where)
    sums, counts = _reduce(values, where, segment_ids, num_segments)
    return sums / jnp.maximum(counts, 1)
