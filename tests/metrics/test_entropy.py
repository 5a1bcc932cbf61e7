"""Entropy statistics (tunelib/metrics/_entropy.py)."""

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
from tunelib import metrics

entropy_statistics = jax.jit(metrics.entropy_statistics)


def masked(x, where):
    return np.where(where, x, np.nan).astype(np.float32)


@st.composite
def entropies(draw, max_b=3, max_t=4, grid=False):
    """`[B, T]` entropies and a mask; on a grid of multiples of 1/4 when `grid` (many ties)."""
    b, t = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    if grid:
        ints = draw(st.lists(st.integers(0, 12), min_size=b * t, max_size=b * t))
        values = np.array(ints, np.float32).reshape(b, t) / 4
    else:
        values = draw(float_arrays((b, t), 0.0, 10.0))
    return values, draw(bool_arrays((b, t)))


@given(entropies())
def test_statistics_match_reference(data):
    entropy, where = data
    stats = entropy_statistics(masked(entropy, where), where=where)
    valid = entropy[where].astype(np.float64)
    expected = (valid.mean(), valid.min(), valid.max()) if valid.size else (0.0, 0.0, 0.0)
    for got, want in zip(stats, expected, strict=True):
        assert got.dtype == jnp.float32 and got.shape == ()
        assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_statistics_masks_gradients_and_dtypes():
    entropy = np.array([[1.0, np.nan, 2.0], [-np.inf, 0.5, 4.0]], np.float32)
    where = np.array([[True, False, True], [False, True, True]])
    stats = entropy_statistics(entropy, where=where)
    assert (stats.mean, stats.min, stats.max) == (1.875, 0.5, 4.0)
    integer = metrics.entropy_statistics(entropy, where=where.astype(np.int32))
    assert tuple(integer) == tuple(stats)
    grads = jax.grad(lambda h: sum(metrics.entropy_statistics(h, where=where)))(entropy)
    assert_close(grads, np.where(where, 0.25, 0.0) + np.array([[0, 0, 0], [0, 1, 1]]))
    nothing = entropy_statistics(entropy, where=np.zeros_like(where))
    assert tuple(nothing) == (0.0, 0.0, 0.0)
    grad = jax.grad(lambda h: sum(metrics.entropy_statistics(h, where=np.zeros_like(where))))(
        entropy
    )
    assert np.all(np.asarray(grad) == 0)
    low = entropy_statistics(jnp.asarray(entropy, jnp.bfloat16), where=where)
    assert low.mean.dtype == jnp.float32 and tuple(low) == tuple(stats)  # exact in bf16
    with jax.enable_x64(True):
        out = entropy_statistics(np.where(where, entropy, 0.0).astype(np.float64), where=where)
        assert out.mean.dtype == jnp.float64
        assert_close(out.mean, 1.875, rtol=1e-15)
    assert_traced_once(
        metrics.entropy_statistics,
        [((np.where(where, entropy, 0.0) * s,), {"where": where}) for s in (1.0, 2.0)],
    )


def test_errors_name_the_argument():
    entropy = np.ones((2, 3), np.float32)
    with raises_naming("where"):
        metrics.entropy_statistics(entropy, where=np.ones((3, 2), bool))
    with own_checks():
        with raises_naming("entropy", "[B, T]", error=ValueError):
            metrics.entropy_statistics(np.ones(3, np.float32))
        with raises_naming("entropy", error=TypeError):
            metrics.entropy_statistics(np.ones((2, 3), np.int32))
        with raises_naming("where", "(3, 2)", "(2, 3)", error=ValueError):
            metrics.entropy_statistics(entropy, where=np.ones((3, 2), bool))
