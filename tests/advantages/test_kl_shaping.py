"""KL reward shaping (tunelib/advantages/_kl_shaping.py)."""

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
from tunelib import advantages
from tunelib.losses import KL_ESTIMATORS

kl_reward_shaping = jax.jit(advantages.kl_reward_shaping, static_argnames="estimator")


def ref_kl(logps, ref_logps, estimator):
    """Schulman's estimators in float64, with r = pi_ref / pi_theta."""
    log_r = np.asarray(ref_logps, np.float64) - np.asarray(logps, np.float64)
    return {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": np.expm1(log_r) - log_r}[estimator]


def masked(x, where):
    return np.where(where, x, np.nan).astype(np.float32)


@st.composite
def problems(draw, max_b=3, max_t=4):
    b, t = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    logps = draw(float_arrays((b, t), -20.0, 0.0))
    ref = draw(float_arrays((b, t), -20.0, 0.0))
    return logps, ref, None, draw(bool_arrays((b, t)))


def ref_shaping(rewards, logps, ref_logps, kl_coef, estimator):
    return np.asarray(rewards, np.float64) - kl_coef * ref_kl(logps, ref_logps, estimator)


@given(problems(), st.floats(0.0, 1.0), st.sampled_from(KL_ESTIMATORS), st.data())
def test_matches_reference(problem, kl_coef, estimator, data):
    logps, ref, _, where = problem
    rewards = data.draw(float_arrays(logps.shape, -5.0, 5.0))
    out = kl_reward_shaping(
        masked(rewards, where),
        masked(logps, where),
        masked(ref, where),
        kl_coef=kl_coef,
        estimator=estimator,
        where=where,
    )
    expected = np.where(where, ref_shaping(rewards, logps, ref, kl_coef, estimator), 0.0)
    assert out.dtype == jnp.float32
    assert_close(out, expected, rtol=2e-5, atol=1e-4)


def test_the_penalty_is_data_and_fractions_are_kept():
    rewards = np.array([[0, 0, 1], [0, 1, 0]], np.int32)
    logps = np.array([[-1.0, -2.0, -0.5], [-0.2, -0.3, -5.0]], np.float32)
    ref = np.array([[-1.5, -1.0, -0.8], [-0.1, -0.6, 0.0]], np.float32)
    where = np.array([[True, True, True], [True, True, False]])
    out = kl_reward_shaping(rewards, logps, ref, kl_coef=0.5, where=where)
    assert out.dtype == jnp.float32
    # Integer rewards are cast, not truncated: 1 - 0.5 * 0.3 = 0.85.
    assert_close(out, np.where(where, ref_shaping(rewards, logps, ref, 0.5, "k1"), 0.0))
    assert abs(float(out[0, 2]) - 0.85) < 1e-6
    # The penalty is data: no gradient reaches the log-probs, the rewards pass through.
    grads = jax.grad(
        lambda r, lp, rl: jnp.sum(
            advantages.kl_reward_shaping(r, lp, rl, kl_coef=0.5, where=where)
        ),
        argnums=(0, 1, 2),
    )(rewards.astype(np.float32), logps, ref)
    assert_close(grads[0], where.astype(np.float64))
    assert np.all(np.asarray(grads[1]) == 0) and np.all(np.asarray(grads[2]) == 0)
    # kl_coef = 0 leaves the rewards unchanged.
    assert_close(kl_reward_shaping(rewards, logps, ref, kl_coef=0.0), rewards)


def test_float64_and_bf16():
    rng = np.random.default_rng(4)
    rewards, logps, ref = (rng.uniform(-3, 0, (2, 4)) for _ in range(3))
    with jax.enable_x64(True):
        out = kl_reward_shaping(rewards, logps, ref, kl_coef=0.3, estimator="k3")
        assert out.dtype == jnp.float64
        assert_close(out, ref_shaping(rewards, logps, ref, 0.3, "k3"), rtol=1e-12)
    low = [jnp.asarray(x, jnp.bfloat16) for x in (rewards, logps, ref)]
    out = kl_reward_shaping(*low, kl_coef=0.3)
    assert out.dtype == jnp.float32
    rounded = [np.asarray(x, np.float64) for x in low]
    assert_close(out, ref_shaping(*rounded, 0.3, "k1"), rtol=1e-6, atol=1e-6)


def test_fully_masked_is_zero_and_no_retrace():
    nan = np.full((2, 3), np.nan, np.float32)
    shaped = kl_reward_shaping(nan, nan, nan, kl_coef=0.1, where=np.zeros((2, 3), bool))
    assert np.all(np.asarray(shaped) == 0)
    rng = np.random.default_rng(3)
    rewards, logps, ref = (rng.uniform(-3, 0, (3, 4)).astype(np.float32) for _ in range(3))
    where = np.arange(4)[None, :] < np.array([[1], [4], [2]])
    assert_traced_once(
        advantages.kl_reward_shaping,
        [((rewards, logps, ref), {"kl_coef": jnp.float32(c), "where": where}) for c in (0.1, 0.0)],
    )
    # An integer 0/1 mask counts like the boolean one.
    exact = kl_reward_shaping(rewards, logps, ref, kl_coef=0.2, where=where)
    integer = kl_reward_shaping(rewards, logps, ref, kl_coef=0.2, where=where.astype(np.int8))
    np.testing.assert_array_equal(integer, exact)


def test_errors_name_the_argument():
    x = np.zeros((2, 3), np.float32)
    with raises_naming("rewards_t"):
        advantages.kl_reward_shaping(np.zeros(2), x, x, kl_coef=0.1)
    with own_checks():
        with raises_naming("rewards_t", "(2,)", "(2, 3)", error=ValueError):
            advantages.kl_reward_shaping(np.zeros(2, np.float32), x, x, kl_coef=0.1)
        with raises_naming("rewards_t", error=TypeError):
            advantages.kl_reward_shaping(np.zeros((2, 3), bool), x, x, kl_coef=0.1)
        with raises_naming("kl_coef", error=ValueError):
            advantages.kl_reward_shaping(x, x, x, kl_coef=-0.1)
        with raises_naming("estimator", error=ValueError):
            advantages.kl_reward_shaping(x, x, x, kl_coef=0.1, estimator="k4")
