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
