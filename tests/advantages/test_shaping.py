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
from tests.advantages.test_group import REWARD
from tunelib import advantages

sequence_rewards_to_tokens = jax.jit(
    advantages.sequence_rewards_to_tokens, static_argnames="num_tokens"
)
overlong_penalty = jax.jit(advantages.overlong_penalty)
truncation_mask = jax.jit(advantages.truncation_mask, static_argnames="num_tokens")
dynamic_sampling_mask = jax.jit(advantages.dynamic_sampling_mask, static_argnames="group_size")
group_advantages = jax.jit(advantages.group_advantages, static_argnames="scale")


def ref_tokens(rewards, where):
    out = np.zeros(where.shape)
    for b in range(where.shape[0]):
        steps = np.flatnonzero(where[b])
        if steps.size:
            out[b, steps[-1]] = rewards[b]
    return out


def ref_overlong(length, max_length, buffer_length):
    """DAPO's piecewise soft overlong punishment, case by case."""
    if length <= max_length - buffer_length:
        return 0.0
    if length <= max_length:
        return ((max_length - buffer_length) - length) / buffer_length
    return -1.0


def ref_keep(rewards, where=None):
    r = np.asarray(rewards, np.float64)
    valid = np.isfinite(r) & (True if where is None else where)
    return np.array([len(set(r[i][valid[i]])) > 1 for i in range(r.shape[0])])


@given(float_arrays((4,), -10, 10), bool_arrays((4, 6)))
def test_rewards_on_last_valid_token(rewards, where):
    rewards[~where.any(1)] = np.nan  # an empty row's reward, whatever it is, goes nowhere
    out = np.asarray(sequence_rewards_to_tokens(rewards, where=where))
    assert_close(out, ref_tokens(rewards, where), rtol=0, atol=0)
    assert_close(out.sum(1), np.where(where.any(1), rewards, 0), rtol=1e-6)


def test_tokens_are_float_and_never_truncated():
    where = np.array([[True, True, False], [True, False, True], [False, False, False]])
    out = sequence_rewards_to_tokens(np.array([3, -1, 7], np.int32), where=where)
    assert out.dtype == jnp.float32
    assert_close(out, [[0, 3, 0], [0, 0, -1], [0, 0, 0]], rtol=0, atol=0)
    out = sequence_rewards_to_tokens(np.array([0.5, 0.25, 1.0], np.float32), where=where)
    assert_close(out, [[0, 0.5, 0], [0, 0, 0.25], [0, 0, 0]], rtol=0, atol=0)
    grad = jax.jit(
        jax.grad(lambda r: jnp.sum(advantages.sequence_rewards_to_tokens(r, where=where)))
    )(jnp.array([0.5, 0.25, jnp.nan]))
    assert_close(grad, [1.0, 1.0, 0.0], rtol=0, atol=0)


@given(
    hnp.arrays(np.int32, (8,), elements=st.integers(0, 300)),
    st.integers(1, 200),
    st.integers(1, 100),
)
def test_overlong_penalty_matches_dapo(lengths, max_length, buffer_length):
    buffer_length = min(buffer_length, max_length)
    out = np.asarray(overlong_penalty(lengths, max_length=max_length, buffer_length=buffer_length))
    expected = [ref_overlong(n, max_length, buffer_length) for n in lengths]
    assert_close(out, expected, atol=1e-6)
    assert np.all((out >= -1) & (out <= 0))
    order = np.argsort(lengths, kind="stable")
    assert np.all(np.diff(out[order]) <= 0)  # never rewards a longer completion


def test_overlong_penalty_fixed_values_and_no_retrace():
    lengths = np.array([0, 16384, 16385, 18432, 20480, 20481, 30000])
    out = overlong_penalty(lengths, max_length=20480, buffer_length=4096)
    assert_close(out, [0, 0, -1 / 4096, -0.5, -1, -1, -1], atol=1e-7)
    floats = overlong_penalty(lengths.astype(np.float32), max_length=20480, buffer_length=4096)
    assert_close(floats, out, rtol=0, atol=0)
    assert_traced_once(
        advantages.overlong_penalty,
        [
            ((lengths,), {"max_length": jnp.int32(m), "buffer_length": jnp.float32(c)})
            for m, c in [(20480, 4096), (16384, 1024)]
        ],
    )


def test_truncation_mask():
    where = np.array([[True, True, False], [True, True, True], [True, False, False]])
    out = truncation_mask(np.array([False, True, False]), where=where)
    assert out.dtype == jnp.bool_
    np.testing.assert_array_equal(out, [[True, True, False], [False] * 3, [True, False, False]])
    # Integer 0/1 flags and masks, as TRL passes them, give the same mask.
    ints = truncation_mask(np.array([0, 1, 0], np.int32), where=where.astype(np.int32))
    np.testing.assert_array_equal(ints, out)
    # Without `where`, every token of a completion that was not truncated counts.
    everything = truncation_mask(np.array([0, 1, 0]), num_tokens=4)
    np.testing.assert_array_equal(everything, [[True] * 4, [False] * 4, [True] * 4])


def test_rewards_without_where_go_on_the_last_position():
    rewards = np.array([3, -1, 7], np.int32)
    out = sequence_rewards_to_tokens(rewards, num_tokens=4)
    assert out.dtype == jnp.float32
    assert_close(out, [[0, 0, 0, 3], [0, 0, 0, -1], [0, 0, 0, 7]], rtol=0, atol=0)
    every = np.ones((3, 4), np.int32)
    assert_close(sequence_rewards_to_tokens(rewards, where=every), out, rtol=0, atol=0)
    both = sequence_rewards_to_tokens(rewards, num_tokens=4, where=every.astype(bool))
    assert_close(both, out, rtol=0, atol=0)


def test_flat_groups_give_a_mask_per_completion():
    rewards = np.array([[1, 0, 1], [1, 1, 1], [0, np.nan, 0], [2, np.nan, 3]], np.float32)
    where = np.array([[1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 0]], np.int32)
    grouped = np.asarray(dynamic_sampling_mask(rewards, where=where))
    np.testing.assert_array_equal(grouped, [True, False, False, False])
    flat = dynamic_sampling_mask(rewards.reshape(-1), group_size=3, where=where.reshape(-1))
    np.testing.assert_array_equal(flat, np.repeat(grouped, 3))
    with raises_naming("rewards", "(12,)", "group_size=G", error=ValueError):
        advantages.dynamic_sampling_mask(rewards.reshape(-1))


@given(hnp.arrays(np.float32, (5, 4), elements=REWARD), bool_arrays((5, 4)), bool_arrays((5, 4)))
def test_dynamic_sampling_keeps_groups_with_spread(rewards, nan, where):
    rewards[nan] = np.nan
    keep = np.asarray(dynamic_sampling_mask(rewards, where=where))
    np.testing.assert_array_equal(keep, ref_keep(rewards, where))
    # Exactly the groups with a non-zero group-relative advantage.
    centred = np.asarray(group_advantages(rewards, scale="none", where=where))
    np.testing.assert_array_equal(keep, (centred != 0).any(-1))


def test_dynamic_sampling_fixed_values():
    rewards = np.array([[1, 0, 1], [1, 1, 1], [0, np.nan, 0], [2, np.nan, 3]], np.float32)
    np.testing.assert_array_equal(dynamic_sampling_mask(rewards), [True, False, False, True])
    masked = dynamic_sampling_mask(rewards, where=np.array([[True, False, True]] * 4))
    np.testing.assert_array_equal(masked, [False, False, False, True])
    ints = dynamic_sampling_mask(np.array([[[0, 1], [1, 1]]], np.int32))
    np.testing.assert_array_equal(ints, [[True, False]])


def test_errors_name_the_argument():
    where = jnp.ones((2, 3), bool)
    with raises_naming("rewards"):
        advantages.sequence_rewards_to_tokens(jnp.ones(3), where=where)
    with raises_naming("truncated"):
        advantages.truncation_mask(jnp.ones(2), where=where)
    with raises_naming("lengths"):
        advantages.overlong_penalty(jnp.ones((2, 2)), max_length=4, buffer_length=2)
    with own_checks():
        with raises_naming("where", "(2, 3)", "(3,)", error=ValueError):
            advantages.sequence_rewards_to_tokens(jnp.ones(3), where=where)
        with raises_naming("rewards", "[B]", error=ValueError):
            advantages.sequence_rewards_to_tokens(jnp.ones((2, 3)), where=where)
        with raises_naming("rewards", error=TypeError):
            advantages.sequence_rewards_to_tokens(jnp.ones(2, bool), where=where)
        with raises_naming("where", error=TypeError):
            advantages.sequence_rewards_to_tokens(jnp.ones(2), where=jnp.ones((2, 3)))
        with raises_naming("where", "num_tokens", error=ValueError):
            advantages.sequence_rewards_to_tokens(jnp.ones(2))
        with raises_naming("where", "num_tokens", error=ValueError):
            advantages.truncation_mask(jnp.ones(2, bool))
        with raises_naming("num_tokens=4", "(2, 3)", error=ValueError):
            advantages.truncation_mask(jnp.ones(2, bool), num_tokens=4, where=where)
        with raises_naming("num_tokens", ">= 1", error=ValueError):
            advantages.sequence_rewards_to_tokens(jnp.ones(2), num_tokens=0)
        with raises_naming("truncated", "0 and 1", error=ValueError):
            advantages.truncation_mask(jnp.array([0, 2]), where=where)
        with raises_naming("buffer_length", error=ValueError):
            advantages.overlong_penalty(jnp.ones(2), max_length=4, buffer_length=0)
        with raises_naming("buffer_length", "max_length", error=ValueError):
            advantages.overlong_penalty(jnp.ones(2), max_length=4, buffer_length=8)
        with raises_naming("max_length", error=ValueError):
            advantages.overlong_penalty(jnp.ones(2), max_length=-4.0, buffer_length=2)
        with raises_naming("lengths", "[B]", error=ValueError):
            advantages.overlong_penalty(jnp.ones((2, 2)), max_length=4, buffer_length=2)
        with raises_naming("truncated", "[B]", error=ValueError):
            advantages.truncation_mask(jnp.ones((2, 1), bool), where=where)
        with raises_naming("where", "(3, 3)", error=ValueError):
            advantages.truncation_mask(jnp.ones(2, bool), where=jnp.ones((3, 3), bool))
        with raises_naming("rewards", error=TypeError):
            advantages.dynamic_sampling_mask(jnp.ones((2, 3), bool))
        with raises_naming("where", "(2, 2)", error=ValueError):
            advantages.dynamic_sampling_mask(jnp.ones((2, 3)), where=jnp.ones((2, 2), bool))
