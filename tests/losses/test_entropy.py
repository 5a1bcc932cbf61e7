import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest
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
from tunelib import losses
from tunelib.logprobs import token_entropy

entropy_bonus = jax.jit(losses.entropy_bonus)
high_entropy_mask = jax.jit(losses.high_entropy_mask, static_argnames="selection")
entropy_statistics = jax.jit(losses.entropy_statistics)


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


# entropy_bonus


@given(entropies(), st.floats(-0.1, 0.1))
def test_bonus_matches_reference(data, coefficient):
    entropy, where = data
    out = entropy_bonus(masked(entropy, where), coefficient=coefficient, where=where)
    assert out.dtype == jnp.float32
    expected = np.where(where, -coefficient * entropy.astype(np.float64), 0.0)
    assert_close(out, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", range(3))
def test_minimising_the_bonus_raises_entropy(seed):
    logits = np.random.default_rng(seed).normal(0, 2, (2, 5, 7)).astype(np.float32)
    where = jnp.array([[True] * 5, [True, True, True, False, False]])

    def loss(x):
        bonus = losses.entropy_bonus(token_entropy(x, where=where), coefficient=0.01, where=where)
        return losses.aggregate(bonus, mode="token_mean", where=where).mean()

    entropy = jax.jit(token_entropy)
    before = entropy(logits, where=where)
    grad = jax.jit(jax.grad(loss))(logits)
    after = entropy(logits - 10.0 * grad, where=where)
    # Every valid token's entropy rises (each only depends on its own logits); masked stay 0.
    assert np.all(np.asarray(after - before)[np.asarray(where)] > 0)
    assert np.all(np.asarray(after)[~np.asarray(where)] == 0)


def test_bonus_gradient_masks_and_dtypes():
    entropy = np.array([[1.0, np.nan, 2.0], [np.inf, 0.5, 3.0]], np.float32)
    where = np.array([[True, False, True], [False, True, True]])
    value, grad = jax.value_and_grad(
        lambda h: jnp.sum(losses.entropy_bonus(h, coefficient=0.5, where=where))
    )(entropy)
    assert value == -0.5 * (1.0 + 2.0 + 0.5 + 3.0)
    assert_close(grad, np.where(where, -0.5, 0.0))
    nothing = entropy_bonus(entropy, coefficient=0.5, where=np.zeros_like(where))
    assert np.all(np.asarray(nothing) == 0)
    low = entropy_bonus(jnp.asarray(entropy, jnp.bfloat16), coefficient=0.5, where=where)
    assert low.dtype == jnp.float32
    assert_close(low, entropy_bonus(entropy, coefficient=0.5, where=where), rtol=2**-8)
    with jax.enable_x64(True):
        out = entropy_bonus(np.where(where, entropy, 0.0).astype(np.float64), coefficient=0.5)
        assert out.dtype == jnp.float64


# high_entropy_mask


def ref_top_k(entropy, where, k):
    """The k valid tokens of largest entropy, ties to the earlier flat position."""
    flat, valid = entropy.ravel(), where.ravel()
    order = [i for i in np.lexsort((np.arange(flat.size), -flat)) if valid[i]]
    out = np.zeros(flat.size, bool)
    out[order[:k]] = True
    return out.reshape(entropy.shape)


def ref_quantile(entropy, where, rho):
    if not where.any():
        return np.zeros(where.shape, bool)
    threshold = np.quantile(entropy[where].astype(np.float64), 1 - rho)  # linear
    return where & (entropy >= threshold)


DYADIC_RHO = st.sampled_from([i / 8 for i in range(9)])


@given(entropies(grid=True), DYADIC_RHO)
def test_top_k_matches_reference(data, rho):
    entropy, where = data
    out = np.asarray(high_entropy_mask(masked(entropy, where), rho=rho, where=where))
    k = math.ceil(rho * where.sum())
    assert out.sum() == k
    np.testing.assert_array_equal(out, ref_top_k(entropy, where, k))
    if 0 < k < where.sum():  # every selected entropy >= every unselected valid one
        assert entropy[out].min() >= entropy[where & ~out].max()


@given(entropies(grid=True), DYADIC_RHO)
def test_quantile_matches_reference(data, rho):
    entropy, where = data
    out = high_entropy_mask(masked(entropy, where), rho=rho, selection="quantile", where=where)
    expected = ref_quantile(entropy, where, rho)
    np.testing.assert_array_equal(np.asarray(out), expected)
    values = entropy[where]
    if values.size and np.unique(values).size == values.size:  # distinct: the stated count
        assert expected.sum() == 1 + math.floor(rho * (values.size - 1))


RHOS = [
    Fraction(1, 3),
    *(Fraction(x) for x in ("0", "0.1", "0.2", "0.3", "0.5", "0.7", "0.9", "1")),
]


@pytest.mark.parametrize("rho", RHOS, ids=str)
def test_top_k_count_is_ceil_of_rho_n(rho):
    # Float rounding of rho (0.2 is 0.2000000029 in float32) must not add a token when rho * n
    # is an integer, for every n up to 60 valid tokens.
    entropy = np.random.default_rng(0).uniform(0, 5, (6, 10)).astype(np.float32)
    counts = []
    for n in range(61):
        where = (np.arange(60) < n).reshape(6, 10)
        out = high_entropy_mask(entropy, rho=jnp.float32(float(rho)), where=where)
        counts.append(int(np.asarray(out).sum()))
    assert counts == [math.ceil(rho * n) for n in range(61)]


def test_ties_masks_and_extremes():
    where = np.array([[True, False, True, True], [True, True, False, True]])
    tied = np.ones((2, 4), np.float32)
    out = np.asarray(high_entropy_mask(tied, rho=0.5, where=where))
    # Exactly ceil(0.5 * 6) = 3 of the tied tokens: the first three valid ones in row order.
    np.testing.assert_array_equal(out, [[True, False, True, True], [False, False, False, False]])
    # The quantile convention keeps every token tied with the threshold.
    quantile = high_entropy_mask(tied, rho=0.5, selection="quantile", where=where)
    np.testing.assert_array_equal(np.asarray(quantile), where)
    # Masked tokens are never selected, whatever their entropy.
    wild = np.array([[0.5, np.inf, 0.1, 0.2], [0.3, 0.4, np.nan, 0.6]], np.float32)
    for selection in ("top_k", "quantile"):
        for rho in (0.0, 0.2, 0.5, 1.0):
            out = np.asarray(high_entropy_mask(wild, rho=rho, selection=selection, where=where))
            assert not np.any(out & ~where)
    assert not np.any(np.asarray(high_entropy_mask(wild, rho=0.0, where=where)))
    np.testing.assert_array_equal(np.asarray(high_entropy_mask(wild, rho=1.0, where=where)), where)
    top = high_entropy_mask(wild, rho=0.0, selection="quantile", where=where)
    np.testing.assert_array_equal(np.asarray(top), wild == 0.6)  # the maximum only
    empty = high_entropy_mask(wild, rho=0.5, where=np.zeros_like(where))
    assert not np.any(np.asarray(empty))
    empty = high_entropy_mask(wild, rho=0.5, selection="quantile", where=np.zeros_like(where))
    assert not np.any(np.asarray(empty))


def test_mask_jit_vmap_and_no_retrace():
    rng = np.random.default_rng(1)
    entropy = rng.uniform(0, 4, (3, 2, 5)).astype(np.float32)
    where = rng.uniform(size=(3, 2, 5)) < 0.7
    for selection in ("top_k", "quantile"):
        mapped = jax.jit(
            jax.vmap(
                lambda h, m, s=selection: losses.high_entropy_mask(h, rho=0.4, selection=s, where=m)
            )
        )(entropy, where)
        for i in range(3):
            single = high_entropy_mask(
                entropy[i], rho=jnp.float32(0.4), selection=selection, where=where[i]
            )
            np.testing.assert_array_equal(np.asarray(mapped[i]), np.asarray(single))
        assert_traced_once(
            lambda h, rho, m, s=selection: losses.high_entropy_mask(
                h, rho=rho, selection=s, where=m
            ),
            [((entropy[0], jnp.float32(r), where[0]), {}) for r in (0.2, 0.5, 0.9)],
        )
        # The same compiled function follows the traced rho.
        counts = [
            int(
                high_entropy_mask(
                    entropy[0], rho=jnp.float32(r), selection=selection, where=where[0]
                ).sum()
            )
            for r in (0.2, 0.4, 0.9)
        ]
        assert counts[0] < counts[1] < counts[2]


# entropy_statistics


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
    grads = jax.grad(lambda h: sum(losses.entropy_statistics(h, where=where)))(entropy)
    assert_close(grads, np.where(where, 0.25, 0.0) + np.array([[0, 0, 0], [0, 1, 1]]))
    nothing = entropy_statistics(entropy, where=np.zeros_like(where))
    assert tuple(nothing) == (0.0, 0.0, 0.0)
    grad = jax.grad(lambda h: sum(losses.entropy_statistics(h, where=np.zeros_like(where))))(
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
        losses.entropy_statistics,
        [((np.where(where, entropy, 0.0) * s,), {"where": where}) for s in (1.0, 2.0)],
    )


# errors


def test_errors_name_the_argument():
    entropy = np.ones((2, 3), np.float32)
    with raises_naming("entropy"):
        losses.entropy_bonus(np.ones((2, 3), np.int32), coefficient=0.1)
    with raises_naming("where"):
        losses.high_entropy_mask(entropy, where=np.ones((2, 3), np.int32))
    with raises_naming("selection"):
        losses.high_entropy_mask(entropy, selection="threshold")
    with raises_naming("where"):
        losses.entropy_statistics(entropy, where=np.ones((3, 2), bool))
    with own_checks():
        for fn, kwargs in (
            (losses.entropy_bonus, {"coefficient": 0.1}),
            (losses.high_entropy_mask, {}),
            (losses.entropy_statistics, {}),
        ):
            with raises_naming("entropy", "[B, T]", error=ValueError):
                fn(np.ones(3, np.float32), **kwargs)
            with raises_naming("entropy", error=TypeError):
                fn(np.ones((2, 3), np.int32), **kwargs)
            with raises_naming("where", "(3, 2)", "(2, 3)", error=ValueError):
                fn(entropy, **kwargs, where=np.ones((3, 2), bool))
        with raises_naming("selection", "top_k", "quantile", error=ValueError):
            losses.high_entropy_mask(entropy, selection="threshold")
        for rho in (-0.1, 1.5):
            with raises_naming("rho", error=ValueError):
                losses.high_entropy_mask(entropy, rho=rho)
