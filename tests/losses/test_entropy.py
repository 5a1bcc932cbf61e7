"""The entropy bonus (tunelib/losses/_entropy.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import (
    assert_close,
    bool_arrays,
    float_arrays,
    own_checks,
    raises_naming,
)
from tunelib import losses
from tunelib.logprobs import token_entropy

entropy_bonus = jax.jit(losses.entropy_bonus)


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


@given(entropies(), st.floats(-0.1, 0.1))
def test_bonus_matches_reference(data, entropy_weight):
    entropy, where = data
    out = entropy_bonus(masked(entropy, where), entropy_weight=entropy_weight, where=where)
    assert out.dtype == jnp.float32
    expected = np.where(where, -entropy_weight * entropy.astype(np.float64), 0.0)
    assert_close(out, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", range(3))
def test_minimising_the_bonus_raises_entropy(seed):
    logits = np.random.default_rng(seed).normal(0, 2, (2, 5, 7)).astype(np.float32)
    where = jnp.array([[True] * 5, [True, True, True, False, False]])

    def loss(x):
        bonus = losses.entropy_bonus(
            token_entropy(x, where=where), entropy_weight=0.01, where=where
        )
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
        lambda h: jnp.sum(losses.entropy_bonus(h, entropy_weight=0.5, where=where))
    )(entropy)
    assert value == -0.5 * (1.0 + 2.0 + 0.5 + 3.0)
    assert_close(grad, np.where(where, -0.5, 0.0))
    nothing = entropy_bonus(entropy, entropy_weight=0.5, where=np.zeros_like(where))
    assert np.all(np.asarray(nothing) == 0)
    integer = losses.entropy_bonus(entropy, entropy_weight=0.5, where=where.astype(np.uint8))
    np.testing.assert_array_equal(
        integer, losses.entropy_bonus(entropy, entropy_weight=0.5, where=where)
    )
    low = entropy_bonus(jnp.asarray(entropy, jnp.bfloat16), entropy_weight=0.5, where=where)
    assert low.dtype == jnp.float32
    assert_close(low, entropy_bonus(entropy, entropy_weight=0.5, where=where), rtol=2**-8)
    with jax.enable_x64(True):
        out = entropy_bonus(np.where(where, entropy, 0.0).astype(np.float64), entropy_weight=0.5)
        assert out.dtype == jnp.float64


def test_errors_name_the_argument():
    entropy = np.ones((2, 3), np.float32)
    with raises_naming("entropy"):
        losses.entropy_bonus(np.ones((2, 3), np.int32), entropy_weight=0.1)
    with own_checks():
        with raises_naming("entropy", "[B, T]", error=ValueError):
            losses.entropy_bonus(np.ones(3, np.float32), entropy_weight=0.1)
        with raises_naming("entropy", error=TypeError):
            losses.entropy_bonus(np.ones((2, 3), np.int32), entropy_weight=0.1)
        with raises_naming("where", "(3, 2)", "(2, 3)", error=ValueError):
            losses.entropy_bonus(entropy, entropy_weight=0.1, where=np.ones((3, 2), bool))
