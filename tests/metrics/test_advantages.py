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
    float_arrays,
    own_checks,
    raises_naming,
)
from tunelib import advantages, metrics

# Rewards on a grid of sixteenths, so that groups of equal rewards are common.
REWARD = st.integers(-160, 160).map(lambda n: n / 16)

advantage_statistics = jax.jit(metrics.advantage_statistics)
zero_std_fraction = jax.jit(metrics.zero_std_fraction)
dynamic_sampling_mask = jax.jit(advantages.dynamic_sampling_mask)


def ref_statistics(values, where):
    x = np.asarray(values, np.float64)[where]
    if x.size == 0:
        return (0.0, 0.0, 0.0, 0.0, 0.0)
    return (x.mean(), x.std(), x.min(), x.max(), float(x.size))


def ref_zero_std_fraction(rewards, where):
    r = np.asarray(rewards, np.float64)
    groups = [r[i][np.isfinite(r[i]) & where[i]] for i in range(r.shape[0])]
    scored = [g for g in groups if g.size]
    if not scored:
        return 0.0
    return np.mean([np.all(g == g[0]) for g in scored])


@given(float_arrays((3, 5), -10, 10), bool_arrays((3, 5)))
def test_statistics_match_reference(values, where):
    values[~where] = np.nan
    stats = advantage_statistics(values, where=where)
    assert all(field.shape == () and field.dtype == jnp.float32 for field in stats)
    assert_close(tuple(stats), ref_statistics(values, where), rtol=1e-5, atol=1e-5)


def test_statistics_fixed_values_and_no_retrace():
    values = np.array([[1.0, -1.0, np.inf], [2.0, 0.0, np.nan]], np.float32)
    where = np.array([[True, True, False], [True, True, False]])
    stats = advantage_statistics(values, where=where)
    assert_close(tuple(stats), (0.5, np.sqrt(1.25), -1.0, 2.0, 4.0))
    empty = advantage_statistics(values, where=np.zeros((2, 3), bool))
    assert all(float(field) == 0.0 for field in empty)
    per_sequence = advantage_statistics(np.array([3.0, 5.0]), where=np.array([True, True]))
    assert_close(tuple(per_sequence), (4.0, 1.0, 3.0, 5.0, 2.0))
    # Without a mask every entry counts; an integer 0/1 mask counts like the boolean one.
    assert_close(tuple(advantage_statistics(np.array([3.0, 5.0]))), tuple(per_sequence))
    integer = advantage_statistics(values, where=where.astype(np.int32))
    np.testing.assert_array_equal(np.array(integer), np.array(stats))
    assert_traced_once(
        metrics.advantage_statistics,
        [((values * s,), {"where": where}) for s in (1.0, 2.0)],
    )


@given(hnp.arrays(np.float32, (6, 4), elements=REWARD), bool_arrays((6, 4)), bool_arrays((6, 4)))
def test_zero_std_fraction_matches_reference(rewards, nan, where):
    rewards[nan] = np.nan
    out = zero_std_fraction(rewards, where=where)
    assert out.shape == () and out.dtype == jnp.float32
    assert_close(out, ref_zero_std_fraction(rewards, where), atol=1e-6)
    # The groups that dynamic sampling drops, among those with a valid reward.
    scored = (np.isfinite(rewards) & where).any(-1)
    kept = np.asarray(dynamic_sampling_mask(rewards, where=where))
    if scored.any():
        assert_close(out, 1.0 - kept[scored].mean(), atol=1e-6)


def test_zero_std_fraction_fixed_values():
    rewards = np.array([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [np.nan, np.nan]], np.float32)
    assert_close(zero_std_fraction(rewards), 2 / 3)
    assert zero_std_fraction(np.full((2, 3), np.nan, np.float32)) == 0.0
    assert_close(zero_std_fraction(np.array([[[1, 2], [3, 3]]], np.int32)), 0.5)
    assert_traced_once(metrics.zero_std_fraction, [((rewards + s,), {}) for s in (0.0, 1.0)])


def test_errors_name_the_argument():
    with raises_naming("advantages"):
        metrics.advantage_statistics(jnp.ones(3, int), where=jnp.ones(3, bool))
    with raises_naming("where"):
        metrics.advantage_statistics(jnp.ones(3), where=jnp.ones(4, bool))
    with own_checks():
        with raises_naming("advantages", error=TypeError):
            metrics.advantage_statistics(jnp.ones(3, int), where=jnp.ones(3, bool))
        with raises_naming("where", "(4,)", "(3,)", error=ValueError):
            metrics.advantage_statistics(jnp.ones(3), where=jnp.ones(4, bool))
        with raises_naming("where", error=TypeError):
            metrics.advantage_statistics(jnp.ones(3), where=jnp.ones(3))
        with raises_naming("rewards", error=TypeError):
            metrics.zero_std_fraction(jnp.ones((2, 3), bool))
        with raises_naming("where", "(2, 2)", error=ValueError):
            metrics.zero_std_fraction(jnp.ones((2, 3)), where=jnp.ones((2, 2), bool))
