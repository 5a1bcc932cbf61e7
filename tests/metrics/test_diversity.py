"""Distinct completions and distinct n-grams of a group (tunelib/metrics/_diversity.py)."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_close, assert_traced_once, own_checks, raises_naming
from tunelib import metrics

distinct_completions = jax.jit(metrics.distinct_completions, static_argnames="group_size")
distinct_ngrams = jax.jit(metrics.distinct_ngrams, static_argnames=("n", "group_size"))


def kept_tokens(completions, where):
    return [tuple(row[keep]) for row, keep in zip(completions, where, strict=True)]


def ref_distinct_completions(completions, where, group_size):
    rows = kept_tokens(completions, where)
    out = []
    for start in range(0, len(rows), group_size):
        group = [r for r in rows[start : start + group_size] if r]
        out.append(len(set(group)) / len(group) if group else 0.0)
    return np.array(out)


def ref_distinct_ngrams(completions, where, group_size, n):
    rows = kept_tokens(completions, where)
    out = []
    for start in range(0, len(rows), group_size):
        grams = [
            r[t : t + n] for r in rows[start : start + group_size] for t in range(len(r) - n + 1)
        ]
        out.append(len(set(grams)) / len(grams) if grams else 0.0)
    return np.array(out)


@st.composite
def groups(draw):
    """`[B*G, T]` token ids from a small vocabulary (many repeats), a mask (not always a
    prefix), the group size and n."""
    b, g, t = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 6))
    size = b * g * t
    tokens = np.array(draw(st.lists(st.integers(0, 2), min_size=size, max_size=size)))
    if draw(st.booleans()):  # some rows copied from others, so whole completions repeat
        tokens = tokens.reshape(b * g, t)[
            draw(st.lists(st.integers(0, b * g - 1), min_size=b * g, max_size=b * g))
        ]
    where = np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size)))
    if draw(st.booleans()):  # right padding, as the sampler returns it
        lengths = np.array(draw(st.lists(st.integers(0, t), min_size=b * g, max_size=b * g)))
        where = np.arange(t) < lengths[:, None]
    return (
        tokens.reshape(b * g, t).astype(np.int32),
        where.reshape(b * g, t),
        g,
        draw(st.integers(1, 4)),
    )


@given(groups())
def test_match_reference(data):
    completions, where, g, n = data
    # Tokens under a False `where` are ignored, whatever they hold.
    noisy = np.where(where, completions, -100 + np.arange(completions.shape[1]))
    out = distinct_completions(noisy, group_size=g, where=where)
    assert out.shape == (completions.shape[0] // g,) and out.dtype == jnp.float32
    assert_close(out, ref_distinct_completions(completions, where, g), rtol=1e-6)
    grams = distinct_ngrams(noisy, n=n, group_size=g, where=where)
    assert grams.shape == out.shape and grams.dtype == jnp.float32
    assert_close(grams, ref_distinct_ngrams(completions, where, g, n), rtol=1e-6)
    # The order of the completions within a group does not matter.
    order = np.concatenate([start + np.arange(g)[::-1] for start in range(0, len(completions), g)])
    np.testing.assert_array_equal(
        distinct_completions(noisy[order], group_size=g, where=where[order]), out
    )
    np.testing.assert_array_equal(
        distinct_ngrams(noisy[order], n=n, group_size=g, where=where[order]), grams
    )


def test_fixed_values_exactness_and_no_retrace():
    same = np.tile(np.array([[4, 5, 6]], np.int32), (4, 1))
    assert_close(distinct_completions(same, group_size=4), [0.25])
    assert_close(distinct_ngrams(same, n=2, group_size=4), [2 / 8])
    # A completion is its kept tokens in order, wherever the padding lies; an empty row is none.
    padded = np.array([[0, 4, 5], [4, 5, 0], [4, 5, 9], [1, 1, 1]], np.int32)
    where = np.array([[0, 1, 1], [1, 1, 0], [1, 1, 1], [0, 0, 0]], bool)
    assert_close(distinct_completions(padded, group_size=4, where=where), [2 / 3])
    assert_close(distinct_completions(padded, group_size=2, where=where), [0.5, 1.0])
    assert_close(distinct_ngrams(padded, n=3, group_size=4, where=where.astype(np.int32)), [1.0])
    assert distinct_ngrams(padded, n=4, group_size=2, where=where).tolist() == [0.0, 0.0]
    # Exact comparison: ids that differ only in their lowest or highest bits stay distinct.
    top = np.iinfo(np.int32).max
    wide = np.array([[top, 0], [top - 1, 0], [-top, 1], [-top, 1]], np.int32)
    assert_close(distinct_completions(wide, group_size=4), [0.75])
    assert_close(distinct_ngrams(wide, n=1, group_size=4), [5 / 8])
    assert_traced_once(
        lambda c, w: (
            metrics.distinct_completions(c, group_size=2, where=w),
            metrics.distinct_ngrams(c, n=2, group_size=2, where=w),
        ),
        [((padded + s, where), {}) for s in (0, 1)],
    )


def test_errors_name_the_argument():
    completions = np.zeros((6, 3), np.int32)
    with raises_naming("group_size", "6", error=ValueError):
        metrics.distinct_completions(completions, group_size=4)
    with raises_naming("group_size", error=ValueError):
        metrics.distinct_ngrams(completions, n=1, group_size=0)
    with raises_naming("group_size", error=TypeError):
        metrics.distinct_completions(completions, group_size=2.0)
    with raises_naming("n", error=ValueError):
        metrics.distinct_ngrams(completions, n=0, group_size=2)
    with own_checks():
        with raises_naming("completions", error=TypeError):
            metrics.distinct_completions(completions.astype(np.float32), group_size=2)
        with raises_naming("completions", "[B*G, T]", error=ValueError):
            metrics.distinct_ngrams(np.zeros(6, np.int32), n=1, group_size=2)
        with raises_naming("where", "(6, 2)", "(6, 3)", error=ValueError):
            metrics.distinct_completions(completions, group_size=2, where=np.ones((6, 2), bool))
