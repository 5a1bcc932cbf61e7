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


def per_step(x, shape):
    """A scalar or a `[B, T]` array of per-step values as float64 `[B, T]`."""
    return np.broadcast_to(np.asarray(x, np.float64), shape)


def ref_gae(rewards, values, where, gamma, lam, bootstrap=None):
    """Float64 GAE from the sum form, A_t = sum_k (prod_{j<k} gamma_j lam_j) delta_{t+k} with
    delta_t = r_t + gamma_t V_{t+1} - V_t (the paper's with per-step gamma_t, lambda_t as in
    rlax), over the valid tokens of each row taken as consecutive steps."""
    out = np.zeros(np.shape(rewards))
    gamma, lam = per_step(gamma, out.shape), per_step(lam, out.shape)
    for b in range(out.shape[0]):
        steps = np.flatnonzero(where[b])
        r = np.asarray(rewards[b], np.float64)[steps]
        v = np.asarray(values[b], np.float64)[steps]
        g, la = gamma[b, steps], lam[b, steps]
        v_next = np.append(v[1:], 0.0 if bootstrap is None else bootstrap[b])
        delta = r + g * v_next - v
        for i, t in enumerate(steps):
            out[b, t] = sum(
                np.prod(g[i : i + k] * la[i : i + k]) * delta[i + k] for k in range(len(steps) - i)
            )
    return out


def ref_returns(rewards, where, gamma, bootstrap=None):
    """Float64 reward-to-go, G_t = sum_k (prod_{j<k} gamma_j) r_{t+k} + (prod_j gamma_j) V_boot,
    over valid tokens."""
    out = np.zeros(np.shape(rewards))
    gamma = per_step(gamma, out.shape)
    for b in range(out.shape[0]):
        steps = np.flatnonzero(where[b])
        r = np.asarray(rewards[b], np.float64)[steps]
        g = gamma[b, steps]
        boot = 0.0 if bootstrap is None else float(bootstrap[b])
        for i, t in enumerate(steps):
            n = len(steps) - i
            out[b, t] = sum(np.prod(g[i : i + k]) * r[i + k] for k in range(n))
            out[b, t] += np.prod(g[i:]) * boot
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


@st.composite
def per_step_values(draw):
    """Per-step discounts and lambdas in [0, 1], some exactly 0 or 1, NaN where masked."""
    gamma = draw(float_arrays(SHAPE, 0.0, 1.0))
    lam = draw(float_arrays(SHAPE, 0.0, 1.0))
    ends = draw(bool_arrays(SHAPE))
    gamma[ends] = draw(st.sampled_from([0.0, 1.0]))
    return gamma, lam


@given(episodes(), per_step_values())
def test_per_step_discounts_match_reference(episode, steps):
    rewards, values, where, bootstrap = episode
    gamma, lam = steps
    garbage = {"gamma": np.where(where, gamma, np.nan), "lambda_": np.where(where, lam, np.nan)}
    kwargs = {"bootstrap_value": bootstrap, "where": where}
    out = np.asarray(gae(rewards, values, **garbage, **kwargs))
    assert_close(out, ref_gae(rewards, values, where, gamma, lam, bootstrap), atol=1e-4)
    returns = discounted_returns(rewards, gamma=garbage["gamma"], **kwargs)
    assert_close(returns, ref_returns(rewards, where, gamma, bootstrap), atol=1e-4)
    targets = lambda_returns(rewards, values, **garbage, **kwargs)
    assert_close(targets, np.where(where, out + np.where(where, values, 0), 0), atol=1e-5)
    # lambda = 1 is the Monte-Carlo return with the same per-step discounts, minus the value.
    ones = np.ones(SHAPE, np.float32)
    monte_carlo = gae(rewards, values, gamma=garbage["gamma"], lambda_=ones, **kwargs)
    assert_close(monte_carlo, np.where(where, returns - np.where(where, values, 0), 0), atol=1e-4)
    for result in (out, returns, targets):
        assert np.all(np.asarray(result)[~where] == 0)


@given(episodes(), st.floats(0, 1), st.floats(0, 1))
def test_constant_per_step_arrays_equal_scalars(episode, gamma, lam):
    rewards, values, where, bootstrap = episode
    kwargs = {"bootstrap_value": bootstrap, "where": where}
    arrays = {
        "gamma": np.full(SHAPE, gamma, np.float32),
        "lambda_": np.full(SHAPE, lam, np.float32),
    }
    scalars = {"gamma": np.float32(gamma), "lambda_": np.float32(lam)}
    for fn in (gae, lambda_returns):
        assert_close(
            fn(rewards, values, **arrays, **kwargs),
            fn(rewards, values, **scalars, **kwargs),
            rtol=0,
            atol=0,
        )
    assert_close(
        discounted_returns(rewards, gamma=arrays["gamma"], **kwargs),
        discounted_returns(rewards, gamma=scalars["gamma"], **kwargs),
        rtol=0,
        atol=0,
    )


def test_a_zero_discount_splits_a_row_into_independent_episodes():
    """gamma_t = 0 after token 2: tokens 0-2 see nothing of tokens 3-5, which give what they
    give as a row of their own."""
    rng = np.random.default_rng(8)
    rewards = rng.normal(size=(1, 6)).astype(np.float32)
    values = rng.normal(size=(1, 6)).astype(np.float32)
    gamma = np.full((1, 6), 0.9, np.float32)
    gamma[0, 2] = 0.0
    lam = np.full((1, 6), 0.8, np.float32)
    out = np.asarray(advantages.gae(rewards, values, gamma=gamma, lambda_=lam))
    first = advantages.gae(rewards[:, :3], values[:, :3], gamma=0.9, lambda_=0.8)
    second = advantages.gae(rewards[:, 3:], values[:, 3:], gamma=0.9, lambda_=0.8)
    assert_close(out, np.concatenate([first, second], axis=1), rtol=1e-6, atol=1e-7)
    returns = advantages.discounted_returns(rewards, gamma=gamma)
    first = advantages.discounted_returns(rewards[:, :3], gamma=0.9)
    second = advantages.discounted_returns(rewards[:, 3:], gamma=0.9)
    assert_close(returns, np.concatenate([first, second], axis=1), rtol=1e-6, atol=1e-7)


def test_per_step_values_errors_and_no_retrace():
    rewards, values = jnp.zeros((2, 3)), jnp.zeros((2, 3))
    where = jnp.array([[True, True, False], [True, True, True]])
    with own_checks():
        for name in ("gamma", "lambda_"):
            with raises_naming(name, "(2, 2)", "(2, 3)", error=ValueError):
                advantages.gae(rewards, values, **{name: jnp.ones((2, 2))}, where=where)
            with raises_naming(name, "(2,)", error=ValueError):
                advantages.gae(rewards, values, **{name: jnp.ones(2)}, where=where)
            bad = jnp.array([[0.5, 0.5, 7.0], [0.5, 1.5, 0.5]])  # 7 is masked, 1.5 is not
            with raises_naming(name, "1.5", error=ValueError):
                advantages.lambda_returns(rewards, values, **{name: bad}, where=where)
            with raises_naming(name, error=TypeError):
                advantages.gae(rewards, values, **{name: jnp.ones((2, 3), bool)}, where=where)
        with raises_naming("gamma", "(3, 2)", error=ValueError):
            advantages.discounted_returns(rewards, gamma=jnp.ones((3, 2)), where=where)
    # vmap over rows with per-row discounts gives the batched result.
    r, val = jax.random.normal(jax.random.key(9), (2, 2, 3))
    gamma = jnp.array([[0.9, 0.0, 0.5], [1.0, 0.7, 0.2]])
    mapped = jax.vmap(
        lambda a, b, g, m: advantages.gae(a[None], b[None], gamma=g[None], where=m[None])[0]
    )(r, val, gamma, where)
    assert_close(mapped, gae(r, val, gamma=gamma, where=where), rtol=1e-6, atol=1e-7)
    assert_traced_once(
        advantages.gae,
        [
            ((rewards, values), {"gamma": g * jnp.ones((2, 3)), "lambda_": lam, "where": where})
            for g, lam in [(1.0, jnp.ones((2, 3))), (0.5, 0.3 * jnp.ones((2, 3)))]
        ],
    )


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


def test_gradients_with_per_step_discounts_are_finite_and_zero_at_masked_tokens():
    rewards = jnp.array([[1.0, jnp.nan, 0.5, 2.0]])
    values = jnp.array([[0.1, jnp.inf, 0.3, 0.4]])
    where = jnp.array([[True, False, True, True]])
    gamma = jnp.array([[0.9, jnp.nan, 0.0, 0.8]])
    lam = jnp.array([[0.5, jnp.nan, 0.9, 0.7]])

    def total(r, v, g, la):
        return jnp.sum(advantages.gae(r, v, gamma=g, lambda_=la, where=where) ** 2)

    grads = jax.grad(total, argnums=(0, 1, 2, 3))(rewards, values, gamma, lam)
    for grad in grads:
        assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[~where] == 0)
    # The zero discount at token 2 cuts token 0's dependence on token 3.
    assert np.asarray(grads[0])[0, 3] != 0
    only_last = jax.grad(
        lambda r: advantages.gae(r, values, gamma=gamma, lambda_=lam, where=where)[0, 0]
    )(rewards)
    assert np.asarray(only_last)[0, 3] == 0 and np.asarray(only_last)[0, 2] != 0


def test_bf16_and_float64():
    rewards = jax.random.normal(jax.random.key(0), (4, 16))
    values = jax.random.normal(jax.random.key(1), (4, 16))
    where = jnp.arange(16) < jnp.array([[16], [9], [1], [12]])
    out = gae(rewards, values.astype(jnp.bfloat16), gamma=0.99, lambda_=0.95, where=where)
    assert out.dtype == jnp.float32
    # Values in bf16 (3 significant digits), statistics in float32: close to all-float32.
    exact = gae(rewards, values, gamma=0.99, lambda_=0.95, where=where)
    assert_close(out, exact, atol=0.05)
    # Per-step discounts in bf16 are read in float32 (0.99 rounds to 0.98828125).
    gamma_t = jnp.full((4, 16), 0.99, jnp.bfloat16)
    out = gae(rewards, values, gamma=gamma_t, lambda_=0.95, where=where)
    assert out.dtype == jnp.float32
    rounded = gae(rewards, values, gamma=jnp.float32(0.98828125), lambda_=0.95, where=where)
    assert_close(out, rounded, rtol=1e-6, atol=1e-6)
    assert_close(out, exact, atol=0.1)
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
