import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import (
    assert_close,
    assert_traced_once,
    bool_arrays,
    float_arrays,
    own_checks,
    raises_naming,
)
from tunelib import logprobs

sequence_sum = jax.jit(logprobs.sequence_sum)
sequence_mean = jax.jit(logprobs.sequence_mean)


def ref_sum(x, where):
    return np.where(where, np.asarray(x, np.float64), 0.0).sum(-1)


def ref_mean(x, where):
    count = np.asarray(where).sum(-1)
    return np.where(count > 0, ref_sum(x, where) / np.maximum(count, 1), 0.0)


@st.composite
def values_and_mask(draw):
    shape = (draw(st.integers(1, 4)), draw(st.integers(1, 6)))
    return draw(float_arrays(shape)), draw(bool_arrays(shape))


@given(values_and_mask())
def test_matches_reference(data):
    x, where = data
    assert_close(sequence_sum(x, where=where), ref_sum(x, where), atol=1e-5)
    assert_close(sequence_mean(x, where=where), ref_mean(x, where), atol=1e-5)


@given(values_and_mask())
def test_masked_equals_dropped(data):
    x, where = data
    for row in range(x.shape[0]):
        kept = x[row][where[row]]
        assert_close(sequence_sum(x, where=where)[row], kept.astype(np.float64).sum(), atol=1e-5)
        expected_mean = kept.astype(np.float64).mean() if kept.size else 0.0
        assert_close(sequence_mean(x, where=where)[row], expected_mean, atol=1e-5)


def test_masked_nan_gives_zero_gradient():
    x = jnp.array([[1.0, jnp.nan, -jnp.inf], [jnp.nan, jnp.nan, jnp.nan]])
    where = jnp.array([[True, False, False], [False, False, False]])
    for fn in (logprobs.sequence_sum, logprobs.sequence_mean):
        value, grad = jax.value_and_grad(lambda x, fn=fn: fn(x, where=where).sum())(x)
        assert value == 1.0
        np.testing.assert_array_equal(grad, [[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_leading_axes_and_no_mask():
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    assert_close(sequence_sum(x), x.sum(-1))
    assert_close(sequence_mean(x), x.mean(-1))
    assert sequence_sum(x.astype(jnp.bfloat16)).dtype == jnp.float32


def test_no_retrace_and_errors():
    x = jnp.ones((2, 3))
    masks = [jnp.array([[True, False, True], [False] * 3]), jnp.ones((2, 3), bool)]
    assert_traced_once(logprobs.sequence_mean, [((x,), {"where": m}) for m in masks])
    with raises_naming("where"):
        logprobs.sequence_sum(x, where=jnp.ones((2, 4), bool))
    with own_checks(), raises_naming("values", error=TypeError):
        logprobs.sequence_mean(jnp.ones((2, 3), int))


# Packed rows: four sequences of 1 to 4 tokens, padded one per row ([4, 4]) or packed two per
# row ([2, 8], segment ids 1 and 2, 0 on padding). One shape each, so one compilation each.


def pack(values, where, lengths):
    """Sequences i = 2 r and 2 r + 1 of the padded batch concatenated into packed row r."""
    packed, packed_where = np.zeros((2, 8), np.float32), np.zeros((2, 8), bool)
    segments, index = np.zeros((2, 8), np.int32), np.zeros((2, 8), np.int32)
    for row in range(2):
        start = 0
        for k in range(2):
            i, n = 2 * row + k, lengths[2 * row + k]
            packed[row, start : start + n] = values[i, :n]
            packed_where[row, start : start + n] = where[i, :n]
            segments[row, start : start + n] = k + 1
            index[row, start : start + n] = i * 4 + np.arange(n)
            start += n
    return packed, packed_where, segments, index


@st.composite
def padded_sequences(draw):
    lengths = np.array(draw(st.lists(st.integers(1, 4), min_size=4, max_size=4)))
    values = draw(float_arrays((4, 4)))
    where = draw(bool_arrays((4, 4))) & (np.arange(4)[None, :] < lengths[:, None])
    return values, where, lengths


@jax.jit
def both_layouts(values, where, packed, packed_where, segments):
    """Per-sequence sums and means and their gradients, padded and packed."""

    def padded(x):
        return logprobs.sequence_sum(x, where=where), logprobs.sequence_mean(x, where=where)

    def packed_fn(x):
        kw = {"where": packed_where, "segment_ids": segments, "num_segments": 2}
        return logprobs.sequence_sum(x, **kw), logprobs.sequence_mean(x, **kw)

    weights = jnp.arange(1.0, 5.0)
    out = []
    for f, x in ((padded, values), (packed_fn, packed)):
        sums, means = f(x)

        def scalar(x, f=f):
            sums, means = f(x)
            return jnp.sum(weights * sums.reshape(-1)) + jnp.sum(weights * means.reshape(-1) ** 2)

        out.append((sums.reshape(-1), means.reshape(-1), jax.grad(scalar)(x)))
    return out


@given(padded_sequences())
def test_packed_equals_padded(data):
    values, where, lengths = data
    packed, packed_where, segments, index = pack(values, where, lengths)
    # Garbage on padding and masked tokens stays out of both.
    values = np.where(where, values, np.nan).astype(np.float32)
    packed = np.where(packed_where, packed, np.nan).astype(np.float32)
    (sums, means, grad), (p_sums, p_means, p_grad) = both_layouts(
        values, where, packed, packed_where, segments
    )
    assert_close(p_sums, sums, rtol=1e-6, atol=1e-6)
    assert_close(p_means, means, rtol=1e-6, atol=1e-6)
    assert_close(p_means, ref_mean(np.nan_to_num(values), where), rtol=1e-6, atol=1e-6)
    # Each packed token's gradient is its padded twin's; padding gets none.
    used = segments > 0
    assert_close(np.asarray(p_grad)[used], np.asarray(grad).reshape(-1)[index[used]], atol=1e-6)
    assert np.all(np.asarray(p_grad)[~used] == 0)


def test_segments_fixed_values_integer_masks_and_errors():
    x = jnp.array([[1.0, 2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 8.0, 9.0, 10.0]])
    segments = jnp.array([[1, 1, 2, 2, 0], [1, 3, 3, 0, 0]])
    where = jnp.array([[1, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    sums = logprobs.sequence_sum(x, where=where, segment_ids=segments, num_segments=3)
    assert_close(sums, [[1.0, 7.0, 0.0], [6.0, 0.0, 15.0]])
    means = logprobs.sequence_mean(x, where=where, segment_ids=segments, num_segments=3)
    assert_close(means, [[1.0, 3.5, 0.0], [6.0, 0.0, 7.5]])
    # An integer 0/1 mask counts like the boolean one, without segments too.
    np.testing.assert_array_equal(
        logprobs.sequence_mean(x, where=where), logprobs.sequence_mean(x, where=where == 1)
    )
    with raises_naming("where", "2", error=ValueError):
        logprobs.sequence_sum(x, where=where * 2)
    with raises_naming("num_segments", error=ValueError):
        logprobs.sequence_sum(x, segment_ids=segments)
    with raises_naming("num_segments", error=ValueError):
        logprobs.sequence_sum(x, num_segments=3)
    with raises_naming("segment_ids", "3", "num_segments = 2", error=ValueError):
        logprobs.sequence_sum(x, segment_ids=segments, num_segments=2)
    with raises_naming("segment_ids"):
        logprobs.sequence_sum(x, segment_ids=segments[:, :4], num_segments=3)
    # A masked token may carry any id; under jit an id past num_segments belongs to none.
    masked = logprobs.sequence_sum(x, where=segments < 3, segment_ids=segments, num_segments=2)
    assert_close(masked, [[3.0, 7.0], [6.0, 0.0]])
    jitted = jax.jit(logprobs.sequence_sum, static_argnames="num_segments")
    assert_close(jitted(x, segment_ids=segments, num_segments=2), [[3.0, 7.0], [6.0, 0.0]])
