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
from tunelib import advantages

gae = jax.jit(advantages.gae)
lambda_returns = jax.jit(advantages.lambda_returns)
discounted_returns = jax.jit(advantages.discounted_returns)

SHAPE = (3, 6)  # one shape, one compilation; the masks vary the sequences' lengths and holes


def ref_gae(rewards, values, where, gamma, lam, bootstrap=None):
    """Float64 GAE from the paper's sum form, A_t = sum_k (gamma lam)^k delta_{t+k}, over the
    valid tokens of each row taken as consecutive steps."""
    out = np.zeros(np.shape(rewards))
    for b in range(out.shape[0]):
        steps = np.flatnonzero(where[b])
        r = np.asarray(rewards[b], np.float64)[steps]
        v = np.asarray(values[b], np.float64)[steps]
        v_next = np.append(v[1:], 0.0 if bootstrap is None else bootstrap[b])
        delta = r + gamma * v_next - v
        for i, t in enumerate(steps):
            out[b, t] = sum((gamma * lam) ** k * delta[i + k] for k in range(len(steps) - i))
    return out


def ref_returns(rewards, where, gamma, bootstrap=None):
    """Float64 reward-to-go, G_t = sum_k gamma^k r_{t+k} + gamma^n V_boot, over valid tokens."""
    out = np.zeros(np.shape(rewards))
    for b in range(out.shape[0]):
        steps = np.flatnonzero(where[b])
        r = np.asarray(rewards[b], np.float64)[steps]
        boot = 0.0 if bootstrap is None else float(bootstrap[b])
        for i, t in enumerate(steps):
            n = len(steps) - i
            out[b, t] = sum(gamma**k * r[i + k] for k in range(n)) + gamma**n * boot
    return out


@st.composite
def episodes(draw):
    rewards = draw(float_arrays(SHAPE, -5, 5))
    values = draw(float_arrays(SHAPE, -5, 5))
    where = draw(bool_arrays(SHAPE))
    # Garbage where masked: it must not leak into anything.
    rewards[~where] = np.nan
    values[~where] = draw(st.sampled_from([np.nan, np.inf, 1e30]))
    bootstrap = draw(st.one_of(st.none(), float_arrays(SHAPE[:1], -5, 5)))
    return rewards, values, where, bootstrap


def test_fixed_values():
    rewards = np.array([[0.0, 0.0, 0.0, 1.0], [0.5, -1.0, 2.0, 0.0]], np.float32)
    values = np.array([[0.5, 0.6, 9.9, 0.8], [1.0, 0.0, -1.0, 2.0]], np.float32)
    where = np.array([[True, True, False, True], [True, True, True, True]])
    for gamma, lam in [(1.0, 1.0), (0.9, 0.5), (0.99, 0.95), (0.5, 0.0)]:
        assert_close(
            gae(rewards, values, gamma=gamma, lambda_=lam, where=where),
            ref_gae(rewards, values, where, gamma, lam),
        )
    # Row 0 with gamma = 0.9, lambda = 0.5, worked by hand (token 2 is skipped).
    a3 = 1.0 - 0.8
    a1 = (0.9 * 0.8 - 0.6) + 0.45 * a3
    a0 = (0.9 * 0.6 - 0.5) + 0.45 * a1
    out = gae(rewards, values, gamma=0.9, lambda_=0.5, where=where)
    assert_close(out[0], [a0, a1, 0.0, a3])
    assert_close(
        discounted_returns(rewards, gamma=0.5, where=where),
        [[0.25, 0.5, 0.0, 1.0], [0.5 - 0.5 + 0.5, -1.0 + 1.0, 2.0, 0.0]],
    )


@given(episodes(), st.floats(0, 1), st.floats(0, 1))
def test_matches_reference(episode, gamma, lam):
    rewards, values, where, bootstrap = episode
    kwargs = {"gamma": gamma, "bootstrap_value": bootstrap, "where": where}
    out = np.asarray(gae(rewards, values, lambda_=lam, **kwargs))
    assert_close(out, ref_gae(rewards, values, where, gamma, lam, bootstrap), atol=1e-4)
    returns = discounted_returns(rewards, **kwargs)
    assert_close(returns, ref_returns(rewards, where, gamma, bootstrap), atol=1e-4)
    # The lambda-returns are the advantages plus the values.
    targets = lambda_returns(rewards, values, lambda_=lam, **kwargs)
    assert_close(targets, np.where(where, out + np.where(where, values, 0), 0), atol=1e-5)
    # lambda = 1 is the Monte-Carlo advantage, reward-to-go minus the value;
    # lambda = 0 is the one-step TD error.
    monte_carlo = gae(rewards, values, lambda_=1.0, **kwargs)
    assert_close(monte_carlo, np.where(where, returns - np.where(where, values, 0), 0), atol=1e-4)
    assert_close(lambda_returns(rewards, values, lambda_=1.0, **kwargs), returns, atol=1e-4)
    td = gae(rewards, values, lambda_=0.0, **kwargs)
    assert_close(td, ref_gae(rewards, values, where, gamma, 0.0, bootstrap), atol=1e-5)
    for result in (out, returns, targets):
        assert np.all(np.asarray(result)[~where] == 0)


@given(episodes())
def test_holes_are_skipped_like_removed_tokens(episode):
    """A masked token inside a row gives what the row gives with the token cut out."""
    rewards, values, where, bootstrap = episode
    row = int(np.argmax(where.sum(1)))
    steps = np.flatnonzero(where[row])
    compact = np.zeros((1, SHAPE[1]), bool)
    compact[0, : steps.size] = True
    pad = SHAPE[1] - steps.size
    packed_r = np.pad(rewards[row, steps], (0, pad))[None]
    packed_v = np.pad(values[row, steps], (0, pad))[None]
    boot = None if bootstrap is None else bootstrap[row : row + 1]
    full = gae(rewards, values, gamma=0.9, lambda_=0.8, bootstrap_value=bootstrap, where=where)
    packed = gae(
        np.repeat(packed_r, 3, 0),
        np.repeat(packed_v, 3, 0),
        gamma=0.9,
        lambda_=0.8,
        bootstrap_value=None if boot is None else np.repeat(boot, 3),
        where=np.repeat(compact, 3, 0),
    )
    assert_close(np.asarray(full)[row, steps], np.asarray(packed)[0, : steps.size], atol=1e-5)


@jax.jit
def _all_estimators(rewards, values, where):
    kwargs = {"gamma": 0.9, "where": where}
    return (
        advantages.gae(rewards, values, lambda_=0.7, **kwargs),
        advantages.lambda_returns(rewards, values, lambda_=0.7, **kwargs),
        advantages.discounted_returns(rewards, **kwargs),
    )


def test_where_none_makes_every_token_a_step_and_integer_masks_count_as_booleans():
    rewards = np.asarray(jax.random.normal(jax.random.key(5), SHAPE))
    values = np.asarray(jax.random.normal(jax.random.key(6), SHAPE))
    every = np.ones(SHAPE, bool)
    for out, expected in zip(
        _all_estimators(rewards, values, None),
        _all_estimators(rewards, values, every),
        strict=True,
    ):
        assert_close(out, expected, rtol=0, atol=0)
    assert_close(
        _all_estimators(rewards, values, None)[0], ref_gae(rewards, values, every, 0.9, 0.7)
    )
    where = np.asarray(jax.random.bernoulli(jax.random.key(7), 0.7, SHAPE))
    for out, expected in zip(
        _all_estimators(rewards, values, where.astype(np.int32)),
        _all_estimators(rewards, values, where),
        strict=True,
    ):
        assert_close(out, expected, rtol=0, atol=0)


def test_fully_masked_and_empty_rows_give_zero():
    rewards = jnp.full((2, 3), jnp.nan)
    values = jnp.full((2, 3), jnp.inf)
    where = jnp.zeros((2, 3), bool)
    boot = jnp.array([5.0, -5.0])
    for out in (
        gae(rewards, values, bootstrap_value=boot, where=where),
        lambda_returns(rewards, values, bootstrap_value=boot, where=where),
        discounted_returns(rewards, bootstrap_value=boot, where=where),
    ):
        assert np.all(np.asarray(out) == 0)


def _total(rewards, values, where):
    kwargs = {"gamma": 0.9, "where": where}
    return (
        jnp.sum(advantages.gae(rewards, values, lambda_=0.7, **kwargs) ** 2)
        + jnp.sum(advantages.lambda_returns(rewards, values, lambda_=0.7, **kwargs))
        + jnp.sum(advantages.discounted_returns(rewards, **kwargs))
    )


def test_gradients_are_finite_and_zero_at_masked_tokens():
    rewards = jnp.array([[1.0, jnp.nan, 0.5, jnp.inf], [0.0, 2.0, -1.0, 1.0]])
    values = jnp.array([[0.1, jnp.inf, 0.3, jnp.nan], [0.5, 0.2, 0.0, 1.0]])
    where = jnp.array([[True, False, True, False], [True, True, True, True]])
    grads = jax.jit(jax.grad(_total, argnums=(0, 1)))(rewards, values, where)
    for grad in grads:
        grad = np.asarray(grad)
        assert np.all(np.isfinite(grad))
        assert np.all(grad[~np.asarray(where)] == 0)
        assert np.all(grad[np.asarray(where)] != 0)


def test_bf16_and_float64():
    rewards = jax.random.normal(jax.random.key(0), (4, 16))
    values = jax.random.normal(jax.random.key(1), (4, 16))
    where = jnp.arange(16) < jnp.array([[16], [9], [1], [12]])
    out = gae(rewards, values.astype(jnp.bfloat16), gamma=0.99, lambda_=0.95, where=where)
    assert out.dtype == jnp.float32
    # Values in bf16 (3 significant digits), statistics in float32: close to all-float32.
    exact = gae(rewards, values, gamma=0.99, lambda_=0.95, where=where)
    assert_close(out, exact, atol=0.05)
    with jax.enable_x64(True):
        r64, v64 = jnp.asarray(rewards, jnp.float64), jnp.asarray(values, jnp.float64)
        out64 = gae(r64, v64, gamma=0.99, lambda_=0.95, where=where)
        assert out64.dtype == jnp.float64
        expected = ref_gae(np.asarray(r64), np.asarray(v64), np.asarray(where), 0.99, 0.95)
        assert_close(out64, expected, rtol=1e-12, atol=1e-12)
    int_rewards = discounted_returns(jnp.array([[1, 2, 3]]), where=jnp.ones((1, 3), bool))
    assert int_rewards.dtype == jnp.float32
    assert_close(int_rewards, [[6.0, 5.0, 3.0]])


def test_vmap_and_no_retrace():
    rewards = jax.random.normal(jax.random.key(2), SHAPE)
    values = jax.random.normal(jax.random.key(3), SHAPE)
    where = jax.random.bernoulli(jax.random.key(4), 0.7, SHAPE)
    expected = gae(rewards, values, gamma=0.9, lambda_=0.8, where=where)
    mapped = jax.jit(
        jax.vmap(
            lambda r, v, m: advantages.gae(r[None], v[None], gamma=0.9, lambda_=0.8, where=m[None])[
                0
            ]
        )
    )
    assert_close(mapped(rewards, values, where), expected, atol=1e-6)
    assert_traced_once(
        advantages.gae,
        [
            (
                (rewards, values),
                {
                    "gamma": jnp.float32(g),
                    "lambda_": jnp.float32(lam),
                    "bootstrap_value": jnp.ones(3) * g,
                    "where": where,
                },
            )
            for g, lam in [(1.0, 1.0), (0.9, 0.5), (0.0, 0.0)]
        ],
    )
    assert_traced_once(
        advantages.discounted_returns,
        [((rewards,), {"gamma": jnp.float32(g), "where": where}) for g in (1.0, 0.5)],
    )
    assert_traced_once(
        advantages.lambda_returns,
        [
            (
                (rewards, values),
                {"gamma": jnp.float32(0.9), "lambda_": jnp.float32(lam), "where": where},
            )
            for lam in (1.0, 0.5)
        ],
    )


@pytest.mark.parametrize("fn", [advantages.gae, advantages.lambda_returns])
def test_errors_name_the_argument(fn):
    rewards, values, where = jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.ones((2, 3), bool)
    with raises_naming("values"):
        fn(rewards, jnp.zeros((2, 4)), where=where)
    with raises_naming("where"):
        fn(rewards, values, where=jnp.ones((2, 3)))
    with own_checks():
        with raises_naming("values", "(2, 4)", "(2, 3)", error=ValueError):
            fn(rewards, jnp.zeros((2, 4)), where=where)
        with raises_naming("values", error=TypeError):
            fn(rewards, jnp.zeros((2, 3), int), where=where)
        with raises_naming("rewards_t", "[B, T]", error=ValueError):
            fn(jnp.zeros(3), jnp.zeros(3), where=jnp.ones(3, bool))
        with raises_naming("rewards_t", error=TypeError):
            fn(rewards > 0, values, where=where)
        with raises_naming("where", "(3, 2)", error=ValueError):
            fn(rewards, values, where=jnp.ones((3, 2), bool))
        with raises_naming("where", "0 and 1", error=ValueError):
            fn(rewards, values, where=jnp.full((2, 3), 3))
        with raises_naming("bootstrap_value", "(3,)", error=ValueError):
            fn(rewards, values, bootstrap_value=jnp.zeros(3), where=where)
        with raises_naming("gamma", error=ValueError):
            fn(rewards, values, gamma=1.5, where=where)
        with raises_naming("lambda_", error=ValueError):
            fn(rewards, values, lambda_=-0.1, where=where)
        with raises_naming("gamma", error=ValueError):
            advantages.discounted_returns(rewards, gamma=-1.0, where=where)
