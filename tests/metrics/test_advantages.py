import itertools
import warnings

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
    float_arrays,
    own_checks,
    raises_naming,
)
from tunelib import advantages, metrics

# Rewards on a grid of sixteenths, so that groups of equal rewards are common.
REWARD = st.integers(-160, 160).map(lambda n: n / 16)

advantage_statistics = jax.jit(metrics.advantage_statistics)
zero_std_fraction = jax.jit(metrics.zero_std_fraction, static_argnames=("scale", "groups"))
reward_statistics = jax.jit(metrics.reward_statistics, static_argnames="ddof")
multi_reward_zero_std_fraction = jax.jit(
    metrics.multi_reward_zero_std_fraction, static_argnames=("combine", "scale", "groups")
)
dynamic_sampling_mask = jax.jit(advantages.dynamic_sampling_mask)


def ref_statistics(values, where, atol=0.0):
    x = np.asarray(values, np.float64)[where]
    if x.size == 0:
        return (0.0,) * 7
    nonzero = (np.abs(x) > atol).mean()
    return (x.mean(), x.std(), x.min(), x.max(), float(x.size), np.abs(x).mean(), nonzero)


def ref_zero_std_fraction(rewards, where):
    r = np.asarray(rewards, np.float64)
    groups = [r[i][np.isfinite(r[i]) & where[i]] for i in range(r.shape[0])]
    scored = [g for g in groups if g.size]
    if not scored:
        return 0.0
    return np.mean([np.all(g == g[0]) for g in scored])


@given(float_arrays((3, 5), -10, 10), bool_arrays((3, 5)), st.sampled_from([0.0, 1e-8, 2.0]))
def test_statistics_match_reference(values, where, atol):
    values[np.abs(values) < 1] = 0.0  # some exact zeros
    values[~where] = np.nan
    stats = advantage_statistics(values, atol=atol, where=where)
    assert all(field.shape == () and field.dtype == jnp.float32 for field in stats)
    assert_close(tuple(stats), ref_statistics(values, where, atol), rtol=1e-5, atol=1e-5)


def test_statistics_fixed_values_and_no_retrace():
    values = np.array([[1.0, -1.0, np.inf], [2.0, 0.0, np.nan]], np.float32)
    where = np.array([[True, True, False], [True, True, False]])
    stats = advantage_statistics(values, where=where)
    assert_close(tuple(stats), (0.5, np.sqrt(1.25), -1.0, 2.0, 4.0, 1.0, 0.75))
    empty = advantage_statistics(values, where=np.zeros((2, 3), bool))
    assert all(float(field) == 0.0 for field in empty)
    per_sequence = advantage_statistics(np.array([3.0, 5.0]), where=np.array([True, True]))
    assert_close(tuple(per_sequence), (4.0, 1.0, 3.0, 5.0, 2.0, 4.0, 1.0))
    # atol: |A| <= atol counts as zero.
    assert advantage_statistics(values, atol=1.5, where=where).nonzero_fraction == 0.25
    low = advantage_statistics(jnp.asarray(values, jnp.bfloat16), where=where)
    assert all(field.dtype == jnp.float32 for field in low)
    np.testing.assert_array_equal(np.array(low), np.array(stats))  # these values are exact
    mapped = jax.vmap(metrics.advantage_statistics)(values[None], where=where[None])
    np.testing.assert_array_equal(np.array(mapped)[:, 0], np.array(stats))
    # Without a mask every entry counts; an integer 0/1 mask counts like the boolean one.
    assert_close(tuple(advantage_statistics(np.array([3.0, 5.0]))), tuple(per_sequence))
    integer = advantage_statistics(values, where=where.astype(np.int32))
    np.testing.assert_array_equal(np.array(integer), np.array(stats))
    assert_traced_once(
        metrics.advantage_statistics,
        [((values * s,), {"atol": jnp.float32(s), "where": where}) for s in (1.0, 2.0)],
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
        with raises_naming("atol", error=ValueError):
            metrics.advantage_statistics(jnp.ones(3), atol=-1.0)


# ---------------------------------------------------------------------------------------------
# TRL's frac_reward_zero_std and reward statistics, transcribed in float64 from
# GRPOTrainer._generate_and_score_completions (TRL 1.16); rewards [N, K], N = groups x G.


def trl_nanstd(x, axis=None):
    """TRL's `nanstd`: Bessel-corrected, NaN for fewer than two values."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(x, axis=axis, keepdims=True)
        variance = np.nanmean((x - mean) ** 2, axis=axis, keepdims=True)
    count = np.sum(~np.isnan(x), axis=axis, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        variance = variance * np.where(count > 1, count / (count - 1), np.nan)
    std = np.sqrt(variance)
    return std if axis is None else np.squeeze(std, axis)


def trl_frac_reward_zero_std(rewards_per_func, group, weights, aggregation, scale):
    r = np.asarray(rewards_per_func, np.float64)
    w = np.asarray(weights, np.float64)
    unscorable = np.isnan(r).all(1)
    if aggregation == "sum_then_normalize":
        rewards = np.nansum(r * w[None, :], axis=1)
        rewards[unscorable] = np.nan
        if scale in ("group", "none"):
            if group > 1:
                std = np.repeat(trl_nanstd(rewards.reshape(-1, group), axis=1), group)
            else:  # evaluation with one completion per prompt
                std = np.zeros_like(rewards)
        elif rewards.size > 1:
            std = np.full(rewards.shape, trl_nanstd(rewards).item())
        else:
            std = np.zeros_like(rewards)
    else:
        grouped = r.reshape(-1, group, r.shape[1])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            mean_k = np.nanmean(grouped, axis=1, keepdims=True)
        if group > 1:
            std_k = np.expand_dims(trl_nanstd(grouped, axis=1), 1)
        else:
            std_k = np.zeros_like(mean_k)
        reward_k = ((grouped - mean_k) / (std_k + 1e-4)).reshape(-1, r.shape[1])
        rewards = np.nansum(reward_k * w[None, :], axis=1)
        rewards[unscorable] = np.nan
        if rewards.size > 1:
            std = np.full(rewards.shape, trl_nanstd(rewards).item())
        else:
            std = np.zeros_like(rewards)
    return np.isclose(std, 0.0, rtol=1e-5, atol=1e-8).mean()  # torch.isclose's defaults


@st.composite
def reward_batches(draw, k=1):
    """Rewards [prompts, G, K] with NaNs, and a completion mask."""
    # A few shapes only: each one compiles the jitted statistics again.
    prompts, group = draw(st.sampled_from([(1, 2), (3, 1), (3, 4)]))
    shape = (prompts, group, k)
    # Three reward values, so that groups without spread are common.
    rewards = draw(hnp.arrays(np.float32, shape, elements=st.sampled_from([0.0, 0.0625, 1.0])))
    rarely = st.sampled_from([False, False, False, True])  # one in four NaN or masked
    rewards[draw(hnp.arrays(np.bool_, shape, elements=rarely))] = np.nan
    return rewards, ~draw(hnp.arrays(np.bool_, (prompts, group), elements=rarely))


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@given(reward_batches())
def test_zero_std_fraction_all_groups_matches_trl(scale, batch):
    rewards, where = batch
    rewards = rewards[..., 0]
    out = zero_std_fraction(rewards, scale=scale, groups="all", where=where)
    masked = np.where(where, rewards, np.nan)  # TRL has no mask: a masked reward is unscored
    expected = trl_frac_reward_zero_std(
        masked.reshape(-1, 1), rewards.shape[-1], [1.0], "sum_then_normalize", scale
    )
    if rewards.shape[-1] > 1 or scale == "batch":
        assert_close(out, expected, atol=1e-6)
    else:  # TRL sets the std of one-completion groups to 0 (evaluation only); undefined here
        assert (out, expected) == (0.0, 1.0)
    # The default counts only scored groups, and a single reward as no spread.
    scored = zero_std_fraction(rewards, scale=scale, where=where)
    if scale == "batch":
        valid = masked[np.isfinite(masked)]
        assert scored == float(valid.size > 0 and np.all(valid == valid[0]))
    else:
        assert_close(scored, ref_zero_std_fraction(rewards, where), atol=1e-6)


@pytest.mark.parametrize("combine", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale", ["group", "batch"])
@given(reward_batches(k=2), st.sampled_from([None, (1.0, 0.5)]))
def test_multi_reward_zero_std_fraction_matches_trl(combine, scale, batch, weights):
    rewards, where = batch
    weights = None if weights is None else np.array(weights, np.float32)
    out = multi_reward_zero_std_fraction(
        rewards, reward_weights=weights, combine=combine, scale=scale, groups="all", where=where
    )
    masked = np.where(where[..., None], rewards, np.nan).reshape(-1, 2)
    w = (1.0, 1.0) if weights is None else weights
    expected = trl_frac_reward_zero_std(masked, rewards.shape[1], w, combine, scale)
    if rewards.shape[1] > 1 or (scale, combine) != ("group", "sum_then_normalize"):
        # (TRL's one-completion groups: see the test above)
        assert_close(out, expected, atol=1e-6)
    if combine == "sum_then_normalize":  # the zero-std fraction of the weighted sum
        finite = np.isfinite(rewards)
        rows = where & finite.any(-1)
        summed = np.where(finite, rewards, 0.0) @ np.asarray(w, np.float32)
        single = zero_std_fraction(summed, scale=scale, where=rows)
        assert_close(
            multi_reward_zero_std_fraction(
                rewards, reward_weights=weights, scale=scale, where=where
            ),
            single,
            atol=1e-6,
        )


def test_zero_std_fraction_counts_groups_as_stated():
    rewards = np.array(
        [[1.0, 0.0, 1.0], [2.0, 2.0, np.nan], [3.0, np.nan, np.nan], [np.nan] * 3], np.float32
    )
    # Scored groups: 3; flat among them: the second and the single reward of the third.
    assert_close(zero_std_fraction(rewards), 2 / 3)
    # All 4 groups; zero std needs two rewards or more: the second only.
    assert_close(zero_std_fraction(rewards, groups="all"), 1 / 4)
    assert zero_std_fraction(rewards, scale="batch") == 0.0
    flat = np.array([[2.0, 2.0], [2.0, np.nan]], np.float32)
    assert zero_std_fraction(flat, scale="batch") == 1.0
    assert zero_std_fraction(flat, scale="batch", groups="all") == 1.0
    single = np.array([[2.0, np.nan], [np.nan, np.nan]], np.float32)
    assert zero_std_fraction(single, scale="batch") == 1.0
    assert zero_std_fraction(single, scale="batch", groups="all") == 0.0
    # "none" judges groups as "group" does.
    assert zero_std_fraction(rewards, scale="none") == zero_std_fraction(rewards)
    multi = np.stack([rewards, rewards * 0], -1)  # the second reward: 0 where scored
    assert_close(metrics.multi_reward_zero_std_fraction(multi), 2 / 3)
    assert metrics.multi_reward_zero_std_fraction(multi, combine="normalize_then_sum") == 0.0
    assert_traced_once(
        lambda r, e: metrics.multi_reward_zero_std_fraction(
            r, combine="normalize_then_sum", eps=e, reward_weights=jnp.array([1.0, e])
        ),
        [((multi + s, jnp.float32(s + 1e-4)), {}) for s in (0.0, 1.0)],
    )
    for scale, groups in itertools.product(("group", "batch"), ("scored", "all")):
        mapped = jax.vmap(
            lambda r, s=scale, g=groups: metrics.zero_std_fraction(r, scale=s, groups=g)
        )(np.stack([rewards, rewards[::-1]]))
        assert mapped[0] == mapped[1] == zero_std_fraction(rewards, scale=scale, groups=groups)


@given(hnp.arrays(np.float32, (6, 3), elements=REWARD), bool_arrays((6, 3)))
def test_reward_statistics_match_trl_and_tunix(rewards, nan):
    rewards[nan] = np.nan
    # TRL: the weighted nansum of the reward functions, unscorable completions left out.
    w = np.array([1.0, 0.5, 2.0], np.float32)
    combined = np.where(np.isnan(rewards).all(-1), np.nan, np.nansum(rewards * w, -1))
    stats = reward_statistics(combined)
    assert all(field.dtype == jnp.float32 for field in stats)
    scored = combined[~np.isnan(combined)].astype(np.float64)
    if scored.size:
        assert_close(stats.mean, np.nanmean(combined.astype(np.float64)), rtol=1e-6, atol=1e-6)
        assert_close(stats.min, scored.min()) and assert_close(stats.max, scored.max())
    if scored.size > 1:
        assert_close(stats.std, trl_nanstd(combined.astype(np.float64)), rtol=1e-5, atol=1e-6)
    else:
        assert stats.std == 0.0
    assert stats.count == scored.size
    per_function = jax.vmap(metrics.reward_statistics, in_axes=-1)(rewards)
    for i in range(3):
        column = rewards[:, i].astype(np.float64)
        if np.isfinite(column).sum() > 1:
            assert_close(per_function.mean[i], np.nanmean(column), rtol=1e-6, atol=1e-6)
            assert_close(per_function.std[i], trl_nanstd(column), rtol=1e-5, atol=1e-6)
    # Tunix: mean, max and min of the summed rewards (all scored).
    total = np.nan_to_num(rewards).sum(-1)
    tunix = reward_statistics(total, ddof=0)
    assert_close([tunix.mean, tunix.max, tunix.min], [total.mean(), total.max(), total.min()])
    assert_close(tunix.std, total.astype(np.float64).std(), rtol=1e-5, atol=1e-6)


def test_reward_statistics_fixed_values_masks_and_dtypes():
    rewards = np.array([[1, 0], [3, 4]], np.int32)
    where = np.array([[True, True], [True, False]])
    stats = metrics.reward_statistics(rewards, where=where)
    assert_close(tuple(stats), (4 / 3, np.std([1.0, 0.0, 3.0], ddof=1), 0.0, 3.0, 3.0))
    assert stats.mean.dtype == jnp.float32  # integer rewards are not truncated
    assert all(float(f) == 0 for f in metrics.reward_statistics(np.full(3, np.nan)))
    integer = metrics.reward_statistics(rewards, where=where.astype(np.uint8))
    np.testing.assert_array_equal(np.array(integer), np.array(stats))
    bf16 = metrics.reward_statistics(jnp.asarray([0.1, 0.7, 0.3], jnp.bfloat16))
    full = metrics.reward_statistics(jnp.asarray([0.1, 0.7, 0.3], jnp.float32))
    assert bf16.mean.dtype == jnp.float32
    assert_close(np.array(bf16), np.array(full), rtol=1e-2, atol=1e-2)
    with jax.enable_x64(True):
        assert metrics.reward_statistics(np.array([1.0, 2.0])).std.dtype == jnp.float64
    assert_traced_once(
        metrics.reward_statistics, [((rewards * s,), {"where": where}) for s in (1, 2)]
    )


def test_new_errors_name_the_argument():
    with raises_naming("groups"):
        metrics.zero_std_fraction(jnp.ones((2, 3)), groups="some")
    with own_checks():
        with raises_naming("groups", "scored", "all", error=ValueError):
            metrics.zero_std_fraction(jnp.ones((2, 3)), groups="some")
        with raises_naming("scale", error=ValueError):
            metrics.zero_std_fraction(jnp.ones((2, 3)), scale="global")
        with raises_naming("rewards", "(6,)", "[B, G]", error=ValueError):
            metrics.zero_std_fraction(jnp.ones(6))
        with raises_naming("rewards", "(6, 2)", "[B, G, K]", error=ValueError):
            metrics.multi_reward_zero_std_fraction(jnp.ones((6, 2)))
        with raises_naming("combine", error=ValueError):
            metrics.multi_reward_zero_std_fraction(jnp.ones((2, 3, 2)), combine="mean")
        with raises_naming("reward_weights", "(3,)", error=ValueError):
            metrics.multi_reward_zero_std_fraction(jnp.ones((2, 3, 2)), reward_weights=jnp.ones(3))
        with raises_naming("ddof", error=ValueError):
            metrics.reward_statistics(jnp.ones(3), ddof=2)
        with raises_naming("rewards", error=TypeError):
            metrics.reward_statistics(jnp.ones(3, bool))
