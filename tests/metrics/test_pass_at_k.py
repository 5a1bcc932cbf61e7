"""pass@k (tunelib/metrics/_evaluation.py)."""

from fractions import Fraction
from math import comb

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_close, assert_traced_once, own_checks, raises_naming
from tunelib import metrics

pass_at_k = jax.jit(metrics.pass_at_k, static_argnames="k")


def ref_pass_at_k(correct, where, k):
    """1 - C(n - c, k) / C(n, k) per row, in exact rational arithmetic, 0 for an empty row."""
    out = []
    for row, kept in zip(np.asarray(correct, bool), np.asarray(where, bool), strict=True):
        n, c = int(kept.sum()), int((row & kept).sum())
        out.append(0.0 if n == 0 else float(1 - Fraction(comb(n - c, k), comb(n, k))))
    return np.array(out, np.float64)


@st.composite
def samples(draw):
    """`[B, n]` correctness, a mask whose rows keep 0 or at least k samples, and k."""
    b, n = draw(st.integers(1, 4)), draw(st.integers(1, 10))
    k = draw(st.integers(1, n))
    correct = np.array(draw(st.lists(st.booleans(), min_size=b * n, max_size=b * n)))
    where = np.zeros((b, n), bool)
    for row in range(b):
        count = draw(st.sampled_from([0, *range(k, n + 1)]))
        where[row, draw(st.permutations(range(n)))[:count]] = True
    return correct.reshape(b, n), where, k


@given(samples())
def test_matches_reference(data):
    correct, where, k = data
    out = pass_at_k(correct, k=k, where=where)
    assert out.shape == (correct.shape[0],) and out.dtype == jnp.float32
    assert_close(out, ref_pass_at_k(correct, where, k), rtol=1e-5, atol=1e-6)
    # pass@1 is the fraction correct; pass@n is whether any is; pass@k rises with k.
    n, c = where.sum(-1), (correct & where).sum(-1)
    if k == 1:
        assert_close(out, np.where(n > 0, c / np.maximum(n, 1), 0.0), rtol=1e-6)
    full = n == correct.shape[1]
    if k == correct.shape[1]:
        np.testing.assert_array_equal(np.asarray(out)[full], (c > 0)[full])
    if k > 1:
        below = pass_at_k(correct, k=k - 1, where=where)
        assert np.all(np.asarray(out) >= np.asarray(below) - 1e-6)


def test_fixed_values_integer_inputs_and_large_n():
    correct = np.array([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], np.int32)
    assert_close(pass_at_k(correct, k=2), [0.5, 5 / 6, 0.0, 1.0], rtol=1e-6)
    where = np.array([[1, 1, 1, 0]] * 4, np.int32)
    np.testing.assert_array_equal(
        pass_at_k(correct, k=2, where=where), pass_at_k(correct[:, :3] == 1, k=2)
    )
    # 200 samples: the binomials (about 1e58) never form; the product form stays accurate.
    big = np.zeros((3, 200), bool)
    big[0, :1], big[1, :100], big[2, :195] = True, True, True
    assert_close(pass_at_k(big, k=50), ref_pass_at_k(big, np.ones_like(big), 50), rtol=1e-5)
    with jax.enable_x64(True):
        assert pass_at_k(big, k=50).dtype == jnp.float32


def test_short_rows_under_jit_and_no_retrace():
    correct = np.array([[True, False, True], [True, True, False], [False] * 3])
    where = np.array([[True, True, True], [True, False, False], [False] * 3])
    # A concrete mask is checked; a traced one cannot be, and its short row gives NaN.
    with raises_naming("k = 2", "row 1", error=ValueError):
        metrics.pass_at_k(correct, k=2, where=where)
    out = pass_at_k(correct, k=2, where=where)
    assert_close(out[0], 1.0)
    assert np.isnan(out[1]) and out[2] == 0.0
    assert_traced_once(
        lambda c, where: metrics.pass_at_k(c, k=2, where=where),
        [((correct ^ flip,), {"where": np.ones_like(where)}) for flip in (False, True)],
    )


def test_errors_name_the_argument():
    correct = np.ones((2, 3), bool)
    for k in (0, 4):
        with raises_naming("k", "n = 3", error=ValueError):
            metrics.pass_at_k(correct, k=k)
    with raises_naming("k", error=TypeError):
        metrics.pass_at_k(correct, k=2.0)
    with raises_naming("k", error=TypeError):
        pass_at_k(correct, k=True)
    with raises_naming("correct", error=ValueError):
        metrics.pass_at_k(np.array([[0, 2, 1]]), k=1)
    with own_checks():
        with raises_naming("correct", "[B, n]", error=ValueError):
            metrics.pass_at_k(np.ones(3, bool), k=1)
        with raises_naming("correct", error=TypeError):
            metrics.pass_at_k(np.ones((2, 3), np.float32), k=1)
        with raises_naming("where", "(3, 2)", "(2, 3)", error=ValueError):
            metrics.pass_at_k(correct, k=1, where=np.ones((3, 2), bool))
