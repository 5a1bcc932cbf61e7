import functools

import hypothesis.extra.numpy as hnp
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
    finite_floats,
    own_checks,
    raises_naming,
)
from tunelib import advantages
from tunelib.advantages import SCALES

group_advantages = jax.jit(
    advantages.group_advantages, static_argnames=("group_size", "scale", "ddof")
)
multi_reward_advantages = jax.jit(
    advantages.multi_reward_advantages, static_argnames=("group_size", "combine", "scale", "ddof")
)
rloo_advantages = jax.jit(advantages.rloo_advantages, static_argnames="group_size")


def ref_group(rewards, where=None, scale="group", ddof=1, eps=1e-4):
    """Float64 reference from GRPO's formula, one group at a time, dropping invalid rows."""
    r = np.asarray(rewards, np.float64)
    valid = np.isfinite(r) & (np.ones(r.shape, bool) if where is None else np.asarray(where))
    pool = r[valid]
    batch_std = pool.std(ddof=ddof) if pool.size > ddof else 0.0
    out = np.zeros(r.shape)
    for idx in np.ndindex(r.shape[:-1]):
        keep = valid[idx]
        x = r[idx][keep]
        if x.size == 0 or np.all(x == x[0]):
            continue
        centered = x - x.mean()
        if scale == "none":
            out[(*idx, keep)] = centered
        else:
            std = x.std(ddof=ddof) if scale == "group" else batch_std
            out[(*idx, keep)] = centered / (std + eps)
    return out


def ref_rloo(rewards, where=None):
    """r_i minus the mean of the other valid rewards of its group."""
    r = np.asarray(rewards, np.float64)
    valid = np.isfinite(r) & (np.ones(r.shape, bool) if where is None else np.asarray(where))
    out = np.zeros(r.shape)
    for idx in np.ndindex(r.shape[:-1]):
        members = np.flatnonzero(valid[idx])
        if members.size < 2 or np.all(r[idx][members] == r[idx][members[0]]):
            continue
        for i in members:
            others = [r[idx][j] for j in members if j != i]
            out[(*idx, i)] = r[idx][i] - np.mean(others)
    return out


def ref_multi(rewards, weights, combine, scale="group", ddof=1, eps=1e-4):
    """GRPO's weighted sum then normalisation, or GDPO's per-reward normalisation then sum."""
    r = np.asarray(rewards, np.float64)
    w = np.asarray(weights, np.float64)
    finite = np.isfinite(r)
    rows = finite.any(-1)
    if combine == "sum_then_normalize":
        summed = np.where(finite, r, 0.0) @ w
        return ref_group(np.where(rows, summed, np.nan), scale=scale, ddof=ddof, eps=eps)
    per_reward = np.stack(
        [ref_group(r[..., k], scale=scale, ddof=ddof, eps=eps) for k in range(r.shape[-1])], -1
    )
    s = per_reward @ w
    if scale == "none":
        return np.where(rows, s, 0.0)
    pool = s[rows]
    std = pool.std(ddof=ddof) if pool.size > ddof else 0.0
    out = np.zeros(s.shape)
    for idx in np.ndindex(s.shape[:-1]):
        x = s[idx][rows[idx]]
        if x.size and not np.all(x == x[0]):
            out[(*idx, rows[idx])] = (x - pool.mean()) / (std + eps)
    return out


# Rewards with many ties (constant groups, repeated values), on a grid of 1/16: every float32
# sum of a group is exact, so the float32 statistics are within rounding of the float64
# reference even when a group's rewards are close together.
REWARD = st.one_of(
    st.sampled_from([0.0, 1.0, -1.0, 0.5, 2.0]), st.integers(-160, 160).map(lambda n: n / 16)
)
WEIGHTS = [0.0, 0.25, 0.5, 1.0, 2.0]
DYADIC = st.integers(-64, 64).map(lambda n: n / 8)  # exact under shifts by integers


@st.composite
def reward_groups(draw, elements=REWARD, shape=(4, 6), with_nan=True):
    """Rewards of a fixed shape (one compilation) with NaN rows: groups of 0 to G valid rows."""
    rewards = draw(hnp.arrays(np.float32, shape, elements=elements))
    if with_nan and draw(st.booleans()):
        rewards[draw(bool_arrays(shape))] = np.nan
    return rewards


def test_fixed_values():
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, np.nan]], np.float32)
    out = group_advantages(rewards)
    # Sample std of (1, 0, 0, 1) is sqrt(1/3); of (3, 1, 2) is 1.
    expected = [[0.5 / (np.sqrt(1 / 3) + 1e-4)] * 4, [1 / 1.0001, -1 / 1.0001, 0.0, 0.0]]
    expected[0] = [e * s for e, s in zip(expected[0], (1, -1, -1, 1), strict=True)]
    assert_close(out, expected)
    assert_close(group_advantages(rewards, ddof=0, eps=0.0)[0], [1.0, -1.0, -1.0, 1.0])
    assert_close(group_advantages(rewards, scale="none"), [[0.5, -0.5, -0.5, 0.5], [1, -1, 0, 0]])
    batch_std = np.std([1, 0, 0, 1, 3, 1, 2], ddof=1)
    assert_close(
        group_advantages(rewards, scale="batch", eps=0.0),
        [[0.5, -0.5, -0.5, 0.5], [1, -1, 0, 0]] / batch_std,
    )
    assert_close(rloo_advantages(rewards), [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [1.5, -1.5, 0, 0]])


@pytest.mark.parametrize("scale", SCALES)
@given(reward_groups(), st.floats(0.0, 0.1), st.sampled_from([0, 1]))
def test_matches_reference(scale, rewards, eps, ddof):
    out = group_advantages(rewards, scale=scale, ddof=ddof, eps=eps)
    # Relative to the advantages' scale (1/std can be large for near-equal rewards).
    expected = ref_group(rewards, scale=scale, ddof=ddof, eps=eps)
    assert_close(out, expected, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(expected).max()))


@given(reward_groups())
def test_rloo_matches_reference_and_rescaled_mean_centring(rewards):
    out = rloo_advantages(rewards)
    assert_close(out, ref_rloo(rewards), rtol=1e-5, atol=1e-4)
    count = np.isfinite(rewards).sum(-1, keepdims=True)
    centred = np.asarray(group_advantages(rewards, scale="none"))
    assert_close(out, count / np.maximum(count - 1, 1) * centred, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scale", SCALES)
@given(reward_groups(elements=DYADIC), st.integers(-50, 50), st.sampled_from([0.25, 2.0, 8.0]))
def test_zero_mean_and_invariances(scale, rewards, shift, factor):
    out = np.asarray(group_advantages(rewards, scale=scale, eps=0.0))
    valid = np.isfinite(rewards)
    assert np.all(out[~valid] == 0) and np.all(np.isfinite(out))
    # Zero mean within every group.
    assert_close(np.where(valid, out, 0).sum(-1), 0.0, atol=1e-4)
    # Shifting every reward by a constant changes nothing (the shift is exact on this grid).
    assert_close(group_advantages(rewards + shift, scale=scale, eps=0.0), out, atol=1e-5)
    # Positive scaling changes nothing once divided by a std; "none" scales along.
    scaled = group_advantages(rewards * np.float32(factor), scale=scale, eps=0.0)
    assert_close(scaled, out * (factor if scale == "none" else 1.0), rtol=1e-5, atol=1e-5)


def _constant_group_checks(rewards):
    outs = [
        advantages.group_advantages(rewards, scale=scale, eps=eps)
        for scale in SCALES
        for eps in (0.0, 1e-4)
    ]
    outs.append(advantages.group_advantages(rewards, ddof=0, eps=0.0))
    return jnp.stack([*outs, advantages.rloo_advantages(rewards)])


_constant_group_outputs = jax.jit(_constant_group_checks)
_constant_group_grads = jax.jit(jax.grad(lambda r: jnp.sum(_constant_group_checks(r))))


@given(st.lists(finite_floats(-1e4, 1e4), min_size=7, max_size=7))
def test_constant_group_is_exactly_zero(values):
    # Three times 0.1 (or 1e4 / 3) has a float32 mean that differs from the common value.
    rewards = np.repeat(np.array([*values, 0.1], np.float32)[:, None], 3, axis=1)
    assert np.all(np.asarray(_constant_group_outputs(rewards)) == 0)
    assert np.all(np.isfinite(np.asarray(_constant_group_grads(rewards))))


@given(
    reward_groups(shape=(1, 6), with_nan=False), st.sets(st.integers(0, 5), min_size=2, max_size=2)
)
def test_nan_and_masked_rows_equal_dropping_them(rewards, dropped):
    drop = np.isin(np.arange(6), list(dropped))[None]
    kept = rewards[:, ~drop[0]]
    with_nan = np.where(drop, np.float32(np.nan), rewards)
    for scale in SCALES:
        out = np.asarray(group_advantages(with_nan, scale=scale))
        assert np.all(out[drop] == 0)
        masked = group_advantages(rewards, scale=scale, where=~drop)
        assert_close(masked, out, rtol=0, atol=0)
        assert_close(out[~drop], group_advantages(kept, scale=scale)[0], atol=1e-5)
    out = np.asarray(rloo_advantages(with_nan))
    assert np.all(out[drop] == 0)
    assert_close(out[~drop], rloo_advantages(kept)[0], atol=1e-5)


def test_single_valid_reward_empty_and_fully_masked_groups_give_zero():
    rewards = np.array([[5.0, np.nan, np.nan], [np.nan] * 3, [1.0, 2.0, 3.0]], np.float32)
    for scale in SCALES:
        out = np.asarray(group_advantages(rewards, scale=scale))
        assert np.all(out[:2] == 0) and np.all(out[2, [0, 2]] != 0) and out[2, 1] == 0
        nothing = group_advantages(rewards, scale=scale, where=np.zeros((3, 3), bool))
        assert np.all(np.asarray(nothing) == 0)
    assert np.all(np.asarray(rloo_advantages(rewards))[:2] == 0)


def test_gradients_are_finite_and_zero_at_invalid_rows():
    rewards = jnp.array([[1.0, jnp.nan, 0.0, 3.0, 5.0], [jnp.inf, 2.0, 2.0, 2.0, 2.0]])
    where = jnp.array([[True, True, True, True, False], [True] * 5])
    invalid = np.array([[False, True, False, False, True], [True, False, False, False, False]])
    weights = jnp.arange(10.0).reshape(2, 5)
    for scale, fn in (
        ("group", lambda r: advantages.group_advantages(r, where=where)),
        ("none", lambda r: advantages.group_advantages(r, scale="none", where=where)),
        ("batch", lambda r: advantages.group_advantages(r, scale="batch", where=where)),
        ("group", lambda r: advantages.rloo_advantages(r, where=where)),
    ):
        grad = np.asarray(jax.jit(jax.grad(lambda r, fn=fn: jnp.sum(fn(r) * weights)))(rewards))
        assert np.all(np.isfinite(grad))
        assert np.all(grad[invalid] == 0)
        assert np.any(grad[0, [0, 2, 3]] != 0)
        if scale != "batch":  # the constant row 1 only enters through the batch std
            assert np.all(grad[1] == 0)


def test_integer_and_fractional_rewards_are_never_truncated():
    ints = np.array([[3, 0, 1, 0]], np.int32)
    out = group_advantages(ints)
    assert out.dtype == jnp.float32
    assert_close(out, group_advantages(ints.astype(np.float32)), rtol=0, atol=0)
    fractional = np.array([[0.5, 0.25, 0.0]], np.float32)
    assert_close(group_advantages(fractional, scale="none"), [[0.25, 0.0, -0.25]])


def test_bf16_and_float64():
    rewards = np.asarray(jax.random.uniform(jax.random.key(0), (4, 8)), np.float32)
    low = jnp.asarray(rewards, jnp.bfloat16)
    out = group_advantages(low)
    assert out.dtype == jnp.float32
    # bf16 holds the rewards to 3 significant digits; the statistics then run in float32.
    assert_close(out, group_advantages(np.asarray(low, np.float32)), rtol=0, atol=0)
    assert_close(out, group_advantages(rewards), atol=0.02)
    with jax.enable_x64(True):
        r64 = jnp.asarray(rewards, jnp.float64)
        for fn, ref in ((group_advantages, ref_group), (rloo_advantages, ref_rloo)):
            out64 = fn(r64)
            assert out64.dtype == jnp.float64
            assert_close(out64, ref(rewards), rtol=1e-12, atol=1e-12)


def test_jit_vmap_and_no_retrace():
    rewards = np.asarray(jax.random.normal(jax.random.key(1), (3, 5)))
    where = np.asarray(jax.random.bernoulli(jax.random.key(2), 0.8, (3, 5)))
    expected = ref_group(rewards, where)
    assert_close(group_advantages(rewards, where=where), expected, atol=1e-5)
    mapped = jax.jit(jax.vmap(lambda r, m: advantages.group_advantages(r, group_size=5, where=m)))
    assert_close(mapped(rewards, where), expected, atol=1e-5)
    # Each row of the vmap is one flat group: group_size says so.
    rloo_rows = jax.vmap(functools.partial(advantages.rloo_advantages, group_size=5))
    assert_close(jax.jit(rloo_rows)(rewards), ref_rloo(rewards))
    assert_traced_once(
        advantages.group_advantages,
        [((rewards,), {"eps": jnp.float32(e), "where": where}) for e in (1e-4, 1e-6, 0.0)],
    )
    assert_traced_once(advantages.rloo_advantages, [((rewards * s,), {}) for s in (1.0, 2.0)])
    weights = [jnp.array([1.0, 0.5]), jnp.array([0.2, 2.0])]
    assert_traced_once(
        advantages.multi_reward_advantages,
        [
            ((rewards[..., None] * w,), {"reward_weights": w, "eps": jnp.float32(0.1)})
            for w in weights
        ],
    )


@pytest.mark.parametrize("combine", advantages.COMBINES)
@pytest.mark.parametrize("scale", SCALES)
@given(st.data())
def test_multi_reward_matches_reference(combine, scale, data):
    rewards = data.draw(hnp.arrays(np.float32, (3, 5, 3), elements=REWARD))
    if data.draw(st.booleans()):
        rewards[data.draw(bool_arrays(rewards.shape))] = np.nan
    weights = data.draw(hnp.arrays(np.float32, (3,), elements=st.sampled_from(WEIGHTS)))
    out = multi_reward_advantages(rewards, reward_weights=weights, combine=combine, scale=scale)
    expected = ref_multi(rewards, weights, combine, scale)
    assert_close(out, expected, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(expected).max()))


def test_multi_reward_orders_differ_as_gdpo_says():
    # Two binary rewards: the sums (0, 1) and (0, 2) collapse under GRPO, not under GDPO.
    rewards = np.array([[[0, 0], [0, 1]], [[0, 0], [1, 1]]], np.float32)
    grpo = np.asarray(multi_reward_advantages(rewards, eps=0.0))
    assert_close(grpo[0], grpo[1], rtol=0, atol=0)
    gdpo = np.asarray(multi_reward_advantages(rewards, combine="normalize_then_sum", eps=0.0))
    assert_close(gdpo[1], 2 * gdpo[0], atol=1e-6)
    assert_close(gdpo.std(ddof=1), 1.0, atol=1e-6)
    # With one reward, summing first is group_advantages of that reward.
    single = rewards[..., 1:]
    assert_close(multi_reward_advantages(single), group_advantages(single[..., 0]), rtol=0, atol=0)
    # A NaN reward adds nothing to the weighted sum (TRL's nansum); all-NaN rows get 0.
    partial = np.array([[[1, np.nan], [0, 2], [np.nan, np.nan]]], np.float32)
    out = multi_reward_advantages(partial, reward_weights=np.array([1.0, 0.5]), scale="none")
    assert_close(out, [[0.0, 0.0, 0.0]], atol=0)
    out = multi_reward_advantages(partial, reward_weights=np.array([1.0, 2.0]), scale="none")
    assert_close(out, [[-1.5, 1.5, 0.0]])
    grad = jax.jit(
        jax.grad(
            lambda r: jnp.sum(
                advantages.multi_reward_advantages(r, combine="normalize_then_sum")
                * jnp.arange(3.0)
            )
        )
    )(jnp.asarray(partial))
    assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[0, 2] == 0)


def test_errors_name_the_argument():
    rewards = jnp.ones((2, 4))
    with raises_naming("rewards"):
        advantages.group_advantages(rewards > 0)
    with raises_naming("where"):
        advantages.group_advantages(rewards, where=jnp.ones((2, 3), bool))
    with raises_naming("reward_weights"):
        advantages.multi_reward_advantages(rewards[..., None], reward_weights=jnp.ones(2))
    with own_checks():
        with raises_naming("scale", "'group'", "'batch'", "'none'", error=ValueError):
            advantages.group_advantages(rewards, scale="std")
        with raises_naming("ddof", error=ValueError):
            advantages.group_advantages(rewards, ddof=2)
        with raises_naming("eps", error=ValueError):
            advantages.group_advantages(rewards, eps=-1.0)
        with raises_naming("rewards", "bool", error=TypeError):
            advantages.rloo_advantages(rewards > 0)
        with raises_naming("where", "(2, 3)", "(2, 4)", error=ValueError):
            advantages.rloo_advantages(rewards, where=jnp.ones((2, 3), bool))
        with raises_naming("where", error=TypeError):
            advantages.group_advantages(rewards, where=jnp.ones((2, 4)))
        with raises_naming("where", "0 and 1", "2", error=ValueError):
            advantages.rloo_advantages(rewards, where=jnp.full((2, 4), 2))
        with raises_naming("combine", "'normalize_then_sum'", error=ValueError):
            advantages.multi_reward_advantages(rewards[..., None], combine="gdpo")
        with raises_naming("reward_weights", "(2,)", "(1,)", error=ValueError):
            advantages.multi_reward_advantages(rewards[..., None], reward_weights=jnp.ones(2))
        with raises_naming("rewards", "(4,)", error=ValueError):
            advantages.multi_reward_advantages(jnp.ones(4))


def test_flat_rewards_with_group_size_equal_the_grouped_layout():
    rewards = np.array([[1.0, 0.0, 0.5], [2.0, np.nan, 2.0], [3.0, 1.0, -1.0], [0, 0, 1]])
    where = np.array([[1, 1, 0], [1, 1, 1], [1, 1, 1], [0, 1, 1]], np.int32)
    flat, flat_where = rewards.reshape(-1), where.reshape(-1)
    # "batch" and GDPO's batch step: statistics across groups see the same groups.
    grouped = np.asarray(group_advantages(rewards, scale="batch", where=where))
    out = group_advantages(flat, group_size=3, scale="batch", where=flat_where)
    assert out.shape == (12,)
    assert_close(out, grouped.reshape(-1), rtol=0, atol=0)
    assert_close(grouped, ref_group(rewards, where.astype(bool), scale="batch"), atol=1e-5)
    grouped = np.asarray(rloo_advantages(rewards, where=where))
    out = rloo_advantages(flat, group_size=3, where=flat_where)
    assert_close(out, grouped.reshape(-1), rtol=0, atol=0)
    assert_close(out, ref_rloo(rewards, where.astype(bool)).reshape(-1), atol=1e-6)
    several = np.stack([rewards, rewards[::-1]], axis=-1)  # [B, G, K]
    gdpo = {"combine": "normalize_then_sum"}
    grouped = np.asarray(multi_reward_advantages(several, **gdpo, where=where))
    out = multi_reward_advantages(several.reshape(12, 2), group_size=3, **gdpo, where=flat_where)
    assert out.shape == (12,)
    assert_close(out, grouped.reshape(-1), rtol=0, atol=0)


def test_groups_are_never_guessed():
    flat = jnp.arange(6.0)
    for fn in (advantages.group_advantages, advantages.rloo_advantages):
        with raises_naming("rewards", "(6,)", "[B, G]", "[B*G]", "group_size=G", error=ValueError):
            fn(flat)
        with raises_naming("group_size=3", "(2, 3)", "drop group_size", error=ValueError):
            fn(flat.reshape(2, 3), group_size=3)
        with raises_naming("6 completions", "group_size=4", error=ValueError):
            fn(flat, group_size=4)
        with raises_naming("group_size", ">= 1", error=ValueError):
            fn(flat, group_size=0)
        with own_checks(), raises_naming("where", "(6,)", "(3,)", error=ValueError):
            fn(flat, group_size=3, where=jnp.ones(3, bool))
    with raises_naming("rewards", "(6, 2)", "[B, G, K]", "[B*G, K]", error=ValueError):
        advantages.multi_reward_advantages(jnp.ones((6, 2)))
    with raises_naming("group_size=3", "[B*G, K]", error=ValueError):
        advantages.multi_reward_advantages(jnp.ones((2, 3, 2)), group_size=3)
    with own_checks(), raises_naming("group_size", "int", error=TypeError):
        advantages.group_advantages(flat, group_size=2.0)


def test_integer_masks_equal_boolean_masks():
    rewards = np.asarray(jax.random.normal(jax.random.key(5), (3, 4)))
    where = np.array([[1, 0, 1, 1], [1, 1, 1, 1], [0, 0, 1, 0]], np.int8)
    for fn in (group_advantages, rloo_advantages):
        out = fn(rewards, where=where)
        assert_close(out, fn(rewards, where=where.astype(bool)), rtol=0, atol=0)
    assert_close(out, ref_rloo(rewards, where.astype(bool)), atol=1e-5)
