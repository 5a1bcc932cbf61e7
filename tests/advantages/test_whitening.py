import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import (
    assert_close,
    assert_traced_once,
    bool_arrays,
    own_checks,
    raises_naming,
)
from tunelib import advantages

whiten = jax.jit(advantages.whiten, static_argnames=("ddof", "shift_mean"))

SHAPE = (4, 5)


def ref_whiten(values, where, ddof=1, shift_mean=True, eps=1e-8):
    """Float64 masked whitening from its formula: (x - mean) / sqrt(var + eps) on valid entries."""
    x = np.asarray(values, np.float64)
    valid = x[where]
    out = np.zeros(x.shape)
    if valid.size == 0:
        return out
    mean = valid.mean()
    var = valid.var(ddof=ddof) if valid.size > ddof else 0.0
    whitened = (valid - mean) / np.sqrt(var + eps) if var + eps > 0 else np.zeros(valid.size)
    out[where] = whitened + (0.0 if shift_mean else mean)
    return out


# A grid of 1/16: float32 sums are exact, so near-equal values do not turn float32 rounding
# into O(1) errors after division by a tiny std.
GRID = st.integers(-320, 320).map(lambda n: n / 16)


@st.composite
def masked_values(draw):
    values = draw(hnp.arrays(np.float32, SHAPE, elements=GRID))
    where = draw(bool_arrays(SHAPE))
    values[~where] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return values, where


def test_fixed_values():
    x = np.array([[1.0, 2.0, 3.0, np.nan]], np.float32)
    where = np.array([[True, True, True, False]])
    assert_close(whiten(x, where=where), [[-1.0, 0.0, 1.0, 0.0]], atol=1e-6)
    assert_close(whiten(x, where=where, shift_mean=False), [[1.0, 2.0, 3.0, 0.0]], atol=1e-6)
    assert_close(whiten(x, where=where, ddof=0), [[-(1.5**0.5), 0.0, 1.5**0.5, 0.0]], atol=1e-6)
    assert_close(whiten(x, where=where, eps=3.0), [[-0.5, 0.0, 0.5, 0.0]], atol=1e-6)
    integer_mask = whiten(x, where=where.astype(np.int32))  # TRL's 0/1 masks count the same
    assert_close(integer_mask, whiten(x, where=where), rtol=0, atol=0)


@given(masked_values(), st.sampled_from([0, 1]), st.booleans(), st.sampled_from([0.0, 1e-8, 1.0]))
def test_matches_reference(data, ddof, shift_mean, eps):
    values, where = data
    out = whiten(values, where=where, ddof=ddof, shift_mean=shift_mean, eps=eps)
    assert_close(out, ref_whiten(values, where, ddof, shift_mean, eps), rtol=1e-4, atol=1e-4)


@given(masked_values(), st.sampled_from([0, 1]))
def test_unit_std_zero_mean_and_masked_equals_sliced(data, ddof):
    values, where = data
    out = np.asarray(whiten(values, where=where, ddof=ddof, eps=0.0), np.float64)
    assert np.all(out[~where] == 0) and np.all(np.isfinite(out))
    valid = out[where]
    if valid.size > ddof and np.ptp(values[where]) > 1e-3:
        assert_close(valid.mean(), 0.0, atol=1e-5)
        assert_close(valid.std(ddof=ddof), 1.0, atol=1e-5)
    # Whitening the valid entries alone (a flat array of their own) gives the same numbers.
    sliced = np.zeros(SHAPE[0] * SHAPE[1], np.float32)
    sliced[: valid.size] = values[where]
    alone = whiten(sliced, where=np.arange(sliced.size) < valid.size, ddof=ddof, eps=0.0)
    assert_close(np.asarray(alone)[: valid.size], valid, rtol=1e-5, atol=1e-5)


def test_degenerate_inputs_give_zero():
    for where in (np.zeros(SHAPE, bool), np.eye(4, 5, dtype=bool) & (np.arange(5) == 0)):
        values = np.full(SHAPE, np.nan, np.float32)
        values[where] = 3.0
        for eps in (0.0, 1e-8):
            assert np.all(np.asarray(whiten(values, where=where, eps=eps)) == 0)
    constant = np.full(SHAPE, 7.0, np.float32)
    assert np.all(np.asarray(whiten(constant, eps=0.0)) == 0)
    assert np.all(np.asarray(whiten(constant, eps=0.0, shift_mean=False)) == 7.0)


def test_gradients_are_finite_and_zero_at_masked_entries():
    values = jnp.array([[1.0, jnp.nan, 3.0], [jnp.inf, 2.0, 5.0]])
    where = jnp.array([[True, False, True], [False, True, True]])
    weights = jnp.arange(6.0).reshape(2, 3)
    for eps in (0.0, 1e-8):
        grad = jax.jit(
            jax.grad(lambda x, e=eps: jnp.sum(advantages.whiten(x, eps=e, where=where) * weights))
        )(values)
        grad = np.asarray(grad)
        assert np.all(np.isfinite(grad))
        assert np.all(grad[~np.asarray(where)] == 0) and np.any(grad != 0)


def test_reinforce_plus_plus_batch_whitening():
    """REINFORCE++: per-token reward-to-go of KL-shaped rewards, whitened over valid tokens."""
    where = np.array([[True, True, True, False], [True, True, False, False]])
    kl = np.array([[0.1, 0.2, 0.0, 9.0], [0.3, 0.1, 9.0, 9.0]], np.float32)
    token_rewards = -0.5 * kl + advantages.sequence_rewards_to_tokens(
        np.array([1.0, 0.0]), where=where
    )
    returns = advantages.discounted_returns(token_rewards, where=where)
    out = np.asarray(whiten(returns, where=where))
    assert_close(out[where].mean(), 0.0, atol=1e-6)
    assert_close(out[where].std(ddof=1), 1.0, atol=1e-6)
    assert_close(out, ref_whiten(np.asarray(returns), where), atol=1e-6)


def test_bf16_float64_vmap_and_no_retrace():
    values = jax.random.normal(jax.random.key(0), SHAPE) * 3 + 1
    where = jax.random.bernoulli(jax.random.key(1), 0.7, SHAPE)
    low = whiten(values.astype(jnp.bfloat16), where=where)
    assert low.dtype == jnp.float32
    # bf16 keeps 3 significant digits; the result is within 0.02 of the float32 one.
    assert_close(low, whiten(values, where=where), atol=0.02)
    with jax.enable_x64(True):
        v64 = jnp.asarray(values, jnp.float64)
        out = whiten(v64, where=where)
        assert out.dtype == jnp.float64
        assert_close(out, ref_whiten(np.asarray(v64), np.asarray(where)), rtol=1e-12, atol=1e-12)
    per_row = jax.jit(jax.vmap(lambda x, m: advantages.whiten(x, where=m)))(values, where)
    for row in range(SHAPE[0]):
        expected = ref_whiten(np.asarray(values[row]), np.asarray(where[row]))
        assert_close(per_row[row], expected, atol=1e-5)
    assert_traced_once(
        advantages.whiten,
        [((values,), {"eps": jnp.float32(e), "where": where}) for e in (1e-8, 1.0, 0.0)],
    )


def test_errors_name_the_argument():
    values = jnp.ones((2, 3))
    with raises_naming("values"):
        advantages.whiten(jnp.ones((2, 3), int))
    with raises_naming("where"):
        advantages.whiten(values, where=jnp.ones((3, 2), bool))
    with own_checks():
        with raises_naming("values", error=TypeError):
            advantages.whiten(jnp.ones((2, 3), int))
        with raises_naming("where", "(3, 2)", "(2, 3)", error=ValueError):
            advantages.whiten(values, where=jnp.ones((3, 2), bool))
        with raises_naming("ddof", error=ValueError):
            advantages.whiten(values, ddof=2)
        with raises_naming("eps", error=ValueError):
            advantages.whiten(values, eps=-1e-8)
