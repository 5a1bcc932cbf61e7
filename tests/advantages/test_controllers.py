"""Controllers with state (tunelib/advantages/_controllers.py) against float64 NumPy references
of their updates over sequences of steps, run as `lax.scan`s under `jax.jit`."""

import functools
import itertools
import math

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from tests._helpers import (
    assert_close,
    assert_traced_once,
    finite_floats,
    own_checks,
    raises_naming,
)
from tunelib import advantages, losses

STEPS = 6  # steps per trajectory: one compilation serves every generated sequence
B = 4  # values per step

# ---- float64 references, from the papers' formulas ---------------------------------------------


def ref_mean(values, where=None):
    """The float64 mean of the valid entries, or None when there is none or it is not finite."""
    x = np.asarray(values, np.float64)
    where = np.ones(x.shape, bool) if where is None else np.asarray(where, bool)
    if not where.any():
        return None
    mean = x[where].mean()
    return mean if np.isfinite(mean) else None


def ref_kl_coefs(kls, n_steps, *, init, target, horizon, wheres=None):
    """Ziegler et al. (2019): e = clip(KL / target - 1, -0.2, 0.2), beta *= 1 + e n / horizon."""
    beta, out = float(init), []
    for t, (kl, n) in enumerate(zip(kls, n_steps, strict=True)):
        measured = ref_mean(kl, None if wheres is None else wheres[t])
        if measured is not None:
            error = min(max(measured / target - 1.0, -0.2), 0.2)
            beta *= 1.0 + error * float(n) / horizon
        out.append(beta)
    return np.array(out)


def ref_entropy_weights(entropies, *, target, rule, step, init, low, high, wheres=None):
    """Skywork-OR1's additive rule (step up below the target, down otherwise, clip, the weight
    0 above the target) or SAC's log-space rule (c *= exp(step (target - H)), clip)."""
    level, weight, out = float(init), float(init), []
    high = math.inf if high is None else high
    for t, entropy in enumerate(entropies):
        measured = ref_mean(entropy, None if wheres is None else wheres[t])
        if measured is not None:
            below = measured < target
            if rule == "additive":
                level = min(max(level + (step if below else -step), low), high)
                weight = level if below else 0.0
            else:
                level = min(max(level * math.exp(step * (target - measured)), low), high)
                weight = level
        out.append((weight, level))
    return np.array(out)


def ref_reference_points(kl_logps, ref_kl_logps, wheres, *, average, decay):
    """KTO's batch estimate max(0, mean log-ratio), averaged: the first batch as it is, then an
    EMA with `decay` or the mean of every batch."""
    z, count, out = 0.0, 0, []
    for logps, ref, where in zip(kl_logps, ref_kl_logps, wheres, strict=True):
        log_ratio = np.asarray(logps, np.float64) - np.asarray(ref, np.float64)
        measured = ref_mean(log_ratio, where)
        if measured is not None:
            estimate = max(0.0, measured)
            if count == 0:
                z = estimate
            elif average == "ema":
                z = decay * z + (1 - decay) * estimate
            else:
                z = z + (estimate - z) / (count + 1)
            count += 1
        out.append((z, count))
    return np.array(out)


def ref_moments(values, where=None):
    """Count, mean and sum of squared deviations of the valid, finite values, in float64."""
    x = np.asarray(values, np.float64).reshape(-1)
    keep = np.isfinite(x)
    if where is not None:
        keep &= np.asarray(where, bool).reshape(-1)
    x = x[keep]
    if x.size == 0:
        return 0, 0.0, 0.0
    return x.size, x.mean(), ((x - x.mean()) ** 2).sum()


def ref_normalize(rewards, moments, *, center=True, ddof=1, eps=1e-8, where=None):
    count, mean, m2 = moments
    x = np.asarray(rewards, np.float64)
    keep = np.isfinite(x) if where is None else np.isfinite(x) & np.asarray(where, bool)
    scale = math.sqrt(m2 / (count - ddof)) + eps if count > ddof else 1.0
    out = ((x - mean) if center else x) / scale
    return np.where(keep, out, 0.0)


# ---- trajectories: lax.scan over steps under jit -----------------------------------------------


def kl_trajectory(kls, n_steps, wheres, init_kl_coef, target_kl, horizon):
    controller = advantages.adaptive_kl_controller(
        init_kl_coef=init_kl_coef, target_kl=target_kl, horizon=horizon
    )

    def step(state, inputs):
        kl, n, where = inputs
        state = controller.update(kl, state, n_steps=n, where=where)
        return state, state.kl_coef

    return jax.lax.scan(step, controller.init(), (kls, n_steps, wheres))[1]


def entropy_trajectory(entropies, wheres, target, step_size, init, low, high, *, rule):
    controller = advantages.adaptive_entropy_controller(
        target_entropy=target,
        init_entropy_weight=init,
        rule=rule,
        step_size=step_size,
        min_entropy_weight=low,
        max_entropy_weight=high,
    )

    def step(state, inputs):
        entropy, where = inputs
        state = controller.update(entropy, state, where=where)
        return state, jnp.stack([state.entropy_weight, state.level])

    return jax.lax.scan(step, controller.init(), (entropies, wheres))[1]


def kto_trajectory(kl_logps, ref_kl_logps, wheres, decay, *, average):
    controller = advantages.running_kto_reference_point(average=average, decay=decay)

    def step(state, inputs):
        state = controller.update(*inputs[:2], state, where=inputs[2])
        return state, (state.reference_point, state.count)

    return jax.lax.scan(step, controller.init(), (kl_logps, ref_kl_logps, wheres))[1]


def moments_trajectory(rewards, wheres):
    normalizer = advantages.reward_normalizer()

    def step(state, inputs):
        state = normalizer.update(inputs[0], state, where=inputs[1])
        return state, state

    return jax.lax.scan(step, normalizer.init(), (rewards, wheres))[1]


kl_steps = jax.jit(kl_trajectory)
entropy_steps = jax.jit(entropy_trajectory, static_argnames="rule")
kto_steps = jax.jit(kto_trajectory, static_argnames="average")
moments_steps = jax.jit(moments_trajectory)
NORMALIZER = advantages.reward_normalizer()
update_moments = jax.jit(NORMALIZER.update)
merge_moments = jax.jit(NORMALIZER.merge)


def all_valid(shape=(STEPS, B)):
    return np.ones(shape, bool)


def with_nan_where_masked(x, where):
    return np.where(where, x, np.nan).astype(np.float32)


# Measurements: finite values, sometimes NaN (a step that must be skipped).
def measurements(low, high):
    return hnp.arrays(
        np.float32, (STEPS,), elements=st.one_of(finite_floats(low, high), st.just(np.nan))
    )


# ---- the adaptive and fixed KL controllers ------------------------------------------------------


def test_kl_controller_fixed_sequence():
    # Above the target (clipped at +0.2), on target, below (clipped at -0.2), NaN (skipped),
    # a negative k1 estimate, a little above the target.
    kls = np.array([9.0, 6.0, 1.0, np.nan, -3.0, 6.6], np.float32)
    n_steps = np.array([512, 512, 256, 512, 1024, 512], np.int32)
    coefs = kl_steps(kls, n_steps, all_valid((STEPS,)), 0.2, 6.0, 10000.0)
    expected = ref_kl_coefs(kls, n_steps, init=0.2, target=6.0, horizon=10000.0)
    assert coefs.dtype == jnp.float32
    assert_close(coefs, expected, rtol=1e-6, atol=0)
    first = 0.2 * (1 + 0.2 * 512 / 10000)
    assert_close(expected[:3], [first, first, first * (1 - 0.2 * 256 / 10000)], rtol=1e-12)
    assert coefs[3] == coefs[2]  # NaN: unchanged
    assert_close(coefs[5], coefs[4] * (1 + 0.1 * 0.0512), rtol=1e-6)


@given(
    measurements(-2.0, 30.0),
    st.lists(st.integers(1, 4096), min_size=STEPS, max_size=STEPS),
    st.floats(1e-3, 1.0),
    st.floats(0.5, 12.0),
    st.sampled_from([1000.0, 10000.0]),
)
def test_kl_controller_matches_reference(kls, n_steps, init, target, horizon):
    n_steps = np.asarray(n_steps, np.int32)
    coefs = kl_steps(kls, n_steps, all_valid((STEPS,)), init, target, horizon)
    expected = ref_kl_coefs(kls, n_steps, init=init, target=target, horizon=horizon)
    assert_close(coefs, expected, rtol=1e-5, atol=0)


def test_kl_controller_properties():
    controller = advantages.adaptive_kl_controller(init_kl_coef=0.1, target_kl=2.0, horizon=100)
    update = jax.jit(functools.partial(controller.update, n_steps=10))
    state = controller.init()
    on_target = update(2.0, state)
    assert on_target.kl_coef == state.kl_coef  # e = 0
    # The error saturates at +-20 %: far above the target moves as much as 1.2 x the target.
    assert update(2.4, state).kl_coef == update(200.0, state).kl_coef
    assert_close(update(200.0, state).kl_coef, 0.1 * (1 + 0.2 * 0.1), rtol=1e-6)
    assert_close(update(0.0, state).kl_coef, 0.1 * (1 - 0.2 * 0.1), rtol=1e-6)
    ordered = [float(update(kl, state).kl_coef) for kl in (1.7, 1.9, 2.0, 2.2, 2.39)]
    assert all(a < b for a, b in itertools.pairwise(ordered))
    # Nothing to measure: the state stays.
    nan_kl = update(jnp.array([jnp.nan, 1.0]), state)
    assert nan_kl.kl_coef == state.kl_coef
    empty = update(jnp.array([5.0, 1.0]), state, where=jnp.zeros(2, bool))
    assert empty.kl_coef == state.kl_coef
    fixed = advantages.fixed_kl_controller(kl_coef=0.05)
    fixed_update = jax.jit(functools.partial(fixed.update, n_steps=512))
    fixed_state = fixed.init()
    for kl in (9.0, np.nan, 0.0):
        fixed_state = fixed_update(kl, fixed_state)
    assert fixed_state.kl_coef.dtype == jnp.float32 and fixed_state.kl_coef == np.float32(0.05)
    assert fixed.update(jnp.ones(3), fixed_state).kl_coef == np.float32(0.05)


@given(
    hnp.arrays(np.float32, (STEPS, B), elements=finite_floats(0.0, 20.0)),
    hnp.arrays(np.bool_, (STEPS, B)),
)
def test_kl_controller_masked_per_sequence_kl_equals_sliced(kls, wheres):
    n_steps = np.full(STEPS, 2000, np.int32)
    masked = kl_steps(with_nan_where_masked(kls, wheres), n_steps, wheres, 0.3, 5.0, 1e4)
    expected = ref_kl_coefs(
        [k[w] for k, w in zip(kls, wheres, strict=True)], n_steps, init=0.3, target=5.0,
        horizon=1e4,
    )  # fmt: skip
    assert_close(masked, expected, rtol=1e-5, atol=0)
    controller = advantages.adaptive_kl_controller(init_kl_coef=0.3, target_kl=5.0, horizon=1e4)
    state = controller.init()
    for t in range(STEPS):  # the valid entries alone, step by step
        state = controller.update(kls[t][wheres[t]], state, n_steps=2000)
        assert_close(state.kl_coef, masked[t], rtol=1e-6, atol=0)
    integer_mask = kl_steps(kls, n_steps, wheres.astype(np.int32), 0.3, 5.0, 1e4)
    assert_close(integer_mask, masked, rtol=0, atol=0)


# ---- the adaptive entropy controller ------------------------------------------------------------


def test_entropy_controller_additive_fixed_sequence():
    entropies = np.array([0.1, 0.1, 0.1, 0.3, np.nan, 0.2], np.float32)
    out = entropy_steps(entropies, all_valid((STEPS,)), 0.2, 2e-3, 0.0, 0.0, 0.005, rule="additive")
    # Up 2e-3 twice, up to the cap 5e-3, down (the weight switched off above the target),
    # NaN skipped, on the target counts as above (Skywork-OR1's code).
    expected = [
        (0.002, 0.002), (0.004, 0.004), (0.005, 0.005), (0.0, 0.003), (0.0, 0.003), (0.0, 0.001),
    ]  # fmt: skip
    assert_close(out, expected, rtol=1e-6, atol=1e-9)
    reference = ref_entropy_weights(
        entropies, target=0.2, rule="additive", step=2e-3, init=0.0, low=0.0, high=0.005
    )
    assert_close(out, reference, rtol=1e-6, atol=1e-9)


@given(
    measurements(0.0, 3.0),
    st.sampled_from(["additive", "log"]),
    st.floats(0.05, 2.0),
    st.sampled_from([1e-4, 0.05, 0.5]),
    st.floats(1e-3, 0.01),
    st.sampled_from([0.0, 1e-3]),
    st.sampled_from([0.005, 0.02]),
)
def test_entropy_controller_matches_reference(entropies, rule, target, step, init, low, high):
    wheres = all_valid((STEPS,))
    out = entropy_steps(entropies, wheres, target, step, init, low, high, rule=rule)
    expected = ref_entropy_weights(
        entropies, target=target, rule=rule, step=step, init=init, low=low, high=high
    )
    assert_close(out, expected, rtol=1e-5, atol=1e-9)
    weight, level = np.asarray(out).T
    # The level is clipped into [low, high] by every update that runs: from the first finite
    # measurement on (before it, a start `init` outside the bounds stays as it was).
    ran = np.flatnonzero(np.isfinite(entropies))
    after = level[ran[0] :] if ran.size else level[:0]
    assert np.all(after >= low - 1e-9) and np.all(after <= high + 1e-9)
    assert np.all((weight == level) | ((weight == 0) & (rule == "additive")))


def test_entropy_controller_log_rule_and_no_upper_bound():
    entropies = np.array([0.5, 0.5, 2.0, 1.0, np.nan, 0.0], np.float32)
    out = entropy_steps(entropies, all_valid((STEPS,)), 1.0, 0.1, 0.01, 0.0, None, rule="log")
    expected = ref_entropy_weights(
        entropies, target=1.0, rule="log", step=0.1, init=0.01, low=0.0, high=None
    )
    assert_close(out, expected, rtol=1e-6, atol=0)
    assert_close(out[0], [0.01 * math.exp(0.05)] * 2, rtol=1e-6)
    assert out[3, 1] == out[2, 1]  # on target: unchanged
    assert np.all(out[:, 0] == out[:, 1])  # the weight is the level


def test_entropy_controller_token_mean_under_a_mask():
    # [B, T] entropies per step: the measurement is the token mean over the valid tokens.
    rng = np.random.default_rng(0)
    entropies = rng.uniform(0.0, 0.6, (STEPS, 2, 3)).astype(np.float32)
    wheres = rng.random((STEPS, 2, 3)) < 0.6
    wheres[2] = False  # a step without a valid token: skipped
    garbage = with_nan_where_masked(entropies, wheres)
    args = (0.3, 1e-3, 0.0, 0.0, 0.005)
    out = entropy_steps(garbage, wheres, *args, rule="additive")
    expected = ref_entropy_weights(
        entropies, target=0.3, rule="additive", step=1e-3, init=0.0, low=0.0, high=0.005,
        wheres=wheres,
    )  # fmt: skip
    assert_close(out, expected, rtol=1e-6, atol=1e-9)
    assert np.all(out[2] == out[1])
    # The same as passing each step's token mean (NaN for the empty step) as a scalar.
    means = [entropies[t][wheres[t]].mean() if wheres[t].any() else np.nan for t in range(STEPS)]
    scalars = np.asarray(means, np.float32)
    assert_close(
        entropy_steps(scalars, all_valid((STEPS,)), *args, rule="additive"), out, rtol=0, atol=0
    )


# ---- KTO's running reference point --------------------------------------------------------------


def kto_batches(rng, wheres):
    kl_logps = rng.uniform(-30.0, -5.0, wheres.shape).astype(np.float32)
    shift = rng.uniform(-1.0, 3.0, (wheres.shape[0], 1))  # some batches' mean log-ratio < 0
    ref_kl_logps = (kl_logps - shift + rng.normal(0, 0.5, wheres.shape)).astype(np.float32)
    return kl_logps, ref_kl_logps


def test_kto_reference_point_fixed_sequence():
    kl_logps = np.array([[-20.0, -18.0], [-20.0, -9.0], [-5.0, -6.0], [-4.0, -4.0]], np.float32)
    ref = np.array([[-21.0, -18.5], [-20.25, -9.0], [-4.0, -3.0], [-4.5, -3.5]], np.float32)
    wheres = np.array([[True, True], [True, False], [False, False], [True, True]])
    ema = kto_steps(kl_logps, ref, wheres, 0.5, average="ema")
    # 0.75 taken as it is; then 0.5 * 0.75 + 0.5 * 0.25; an empty batch is skipped; a batch
    # whose mean log-ratio is 0 pulls toward 0.
    assert_close(ema[0], [0.75, 0.5, 0.5, 0.25], rtol=1e-6, atol=0)
    assert np.array_equal(ema[1], [1, 2, 2, 3]) and ema[1].dtype == jnp.int32
    mean = kto_steps(kl_logps, ref, wheres, 0.5, average="mean")
    assert_close(mean[0], [0.75, 0.5, 0.5, 1.0 / 3.0], rtol=1e-6, atol=0)
    # Each batch's estimate is the one `losses.kto_reference_point` gives.
    z = [float(losses.kto_reference_point(kl_logps[t], ref[t], where=wheres[t])) for t in (0, 1)]
    assert_close(z, [0.75, 0.25], rtol=1e-6, atol=0)


@given(
    st.integers(0, 2**32 - 1),
    hnp.arrays(np.bool_, (STEPS, B)),
    st.sampled_from(["ema", "mean"]),
    st.floats(0.0, 1.0),
)
def test_kto_reference_point_matches_reference(seed, wheres, average, decay):
    kl_logps, ref = kto_batches(np.random.default_rng(seed), wheres)
    garbage = with_nan_where_masked(kl_logps, wheres)  # masked rows may hold anything
    out, count = kto_steps(garbage, ref, wheres, decay, average=average)
    expected = ref_reference_points(kl_logps, ref, wheres, average=average, decay=decay)
    assert_close(out, expected[:, 0], rtol=1e-5, atol=1e-5)
    assert np.array_equal(count, expected[:, 1])
    assert np.all(np.asarray(out) >= 0)


def test_kto_reference_point_nan_batch_is_skipped_and_constant_is_kept():
    kl_logps = np.full((STEPS, B), -10.0, np.float32)
    ref = kl_logps - 2.0
    ref[3, 1] = np.nan  # a NaN log-prob at a valid row: the batch is skipped
    for average in ("ema", "mean"):
        out, count = kto_steps(kl_logps, ref, all_valid(), 0.9, average=average)
        assert np.all(np.asarray(out) == 2.0)  # the average of a constant is that constant
        assert np.array_equal(count, [1, 2, 3, 3, 4, 5])


# ---- the running reward normaliser ------------------------------------------------------------


def rewards_with_holes(rng, shape, *, nan_fraction=0.2):
    rewards = rng.normal(3.0, 2.0, shape).astype(np.float32)
    rewards[rng.random(shape) < nan_fraction] = np.nan  # unscorable
    return rewards


def state_tuple(state):
    return int(state.count), float(state.mean), float(state.m2)


def assert_moments(state, expected, *, rtol=1e-5):
    count, mean, m2 = expected
    assert int(state.count) == count
    assert_close(state.mean, mean, rtol=rtol, atol=rtol * (abs(mean) + 1))
    assert_close(state.m2, m2, rtol=rtol, atol=rtol * (m2 + 1))


def test_reward_normalizer_fixed_values():
    rewards = np.array([1.0, 2.0, np.nan, 4.0], np.float32)
    where = np.array([True, True, True, False])
    state = update_moments(rewards, NORMALIZER.init(), where=where)
    assert state.count.dtype == jnp.int32 and state.mean.dtype == jnp.float32
    assert state_tuple(state) == (2, 1.5, 0.5)
    state = update_moments(np.array([3, 4, 5, 6], np.int32), state)  # integers: cast
    assert_moments(state, (6, 3.5, 17.5), rtol=1e-7)  # the moments of 1, 2, 3, 4, 5, 6
    out = jax.jit(NORMALIZER.normalize)(rewards, state, where=where)
    std = math.sqrt(17.5 / 5)
    assert_close(out, [(1 - 3.5) / std, (2 - 3.5) / std, 0.0, 0.0], rtol=1e-6)
    scale_only = advantages.reward_normalizer(center=False, ddof=0, eps=0.5)
    assert_close(
        scale_only.normalize(rewards, state), [1 / (math.sqrt(17.5 / 6) + 0.5),
        2 / (math.sqrt(17.5 / 6) + 0.5), 0.0, 4 / (math.sqrt(17.5 / 6) + 0.5)], rtol=1e-6,
    )  # fmt: skip


def test_reward_normalizer_before_enough_data_and_on_empty_batches():
    rewards = np.array([1.0, -2.0, 5.0], np.float32)
    init = NORMALIZER.init()
    assert state_tuple(init) == (0, 0.0, 0.0)
    assert np.array_equal(NORMALIZER.normalize(rewards, init), rewards)  # scale 1, mean 0
    one = update_moments(np.array([2.0, np.nan], np.float32), init)
    assert state_tuple(one) == (1, 2.0, 0.0)
    assert np.array_equal(NORMALIZER.normalize(rewards, one), rewards - 2.0)  # only centred
    # With ddof=0 one reward gives sigma = 0: with eps=0 the rewards are only centred.
    population = advantages.reward_normalizer(ddof=0, eps=0.0)
    assert np.array_equal(population.normalize(rewards, one), rewards - 2.0)
    assert_close(advantages.reward_normalizer(ddof=0, eps=0.5).normalize(rewards, one),
                 (rewards - 2.0) / 0.5, rtol=1e-7)  # fmt: skip
    # Nothing valid in a batch: the state does not move.
    for batch, where in ((np.full(2, np.nan, np.float32), None), (rewards, np.zeros(3, bool))):
        assert state_tuple(update_moments(batch, one, where=where)) == state_tuple(one)
    # Constant rewards: std 0, the rewards equal to the mean give 0, nothing is NaN.
    constant = update_moments(np.full(3, 7.0, np.float32), init)
    assert np.all(np.asarray(NORMALIZER.normalize(np.full(3, 7.0, np.float32), constant)) == 0)


@given(
    st.integers(0, 2**32 - 1),
    hnp.arrays(np.bool_, (STEPS, B)),
    st.booleans(),
    st.sampled_from([0, 1]),
    st.sampled_from([0.0, 1e-8, 0.5]),
)
def test_reward_normalizer_matches_reference(seed, wheres, center, ddof, eps):
    rng = np.random.default_rng(seed)
    rewards = rewards_with_holes(rng, (STEPS, B))
    states = moments_steps(rewards, wheres)
    for t in range(STEPS):
        state = jax.tree.map(lambda x, t=t: x[t], states)
        assert_moments(state, ref_moments(rewards[: t + 1], wheres[: t + 1]))
    normalizer = advantages.reward_normalizer(center=center, ddof=ddof, eps=eps)
    last = jax.tree.map(lambda x: x[-1], states)
    new = rng.normal(0.0, 4.0, B).astype(np.float32)
    expected = ref_normalize(new, ref_moments(rewards, wheres), center=center, ddof=ddof, eps=eps)
    assert_close(normalizer.normalize(new, last), expected, rtol=1e-5, atol=1e-5)


@given(st.integers(0, 2**32 - 1), st.integers(1, 5))
def test_states_of_shards_merge_into_the_state_of_the_whole(seed, pieces):
    rng = np.random.default_rng(seed)
    rewards = rewards_with_holes(rng, (8 * B,)) * rng.uniform(0.1, 100.0)
    cuts = np.sort(rng.choice(np.arange(1, 8 * B), pieces - 1, replace=False))
    masks = [np.zeros(8 * B, bool) for _ in range(pieces)]
    for k, (a, b) in enumerate(zip([0, *cuts], [*cuts, 8 * B], strict=True)):
        masks[k][a:b] = True  # the shards as masks: one compilation for every split
    whole = update_moments(rewards, NORMALIZER.init())
    states = [update_moments(rewards, NORMALIZER.init(), where=m) for m in masks]
    order = rng.permutation(pieces)
    merged = NORMALIZER.init()
    for k in order:
        merged = merge_moments(merged, states[k])
    assert_moments(merged, state_tuple(whole), rtol=2e-6)
    assert_moments(merged, ref_moments(rewards))
    # Updating step by step, shard after shard, gives the same (Welford's order).
    running = NORMALIZER.init()
    for m in masks:
        running = update_moments(rewards, running, where=m)
    assert_moments(running, state_tuple(whole), rtol=2e-6)
    # The initial state is the identity of `merge`, which is symmetric.
    assert state_tuple(merge_moments(whole, NORMALIZER.init())) == state_tuple(whole)
    assert state_tuple(merge_moments(NORMALIZER.init(), whole)) == state_tuple(whole)
    if pieces > 1:
        ab, ba = merge_moments(states[0], states[1]), merge_moments(states[1], states[0])
        assert_moments(ab, state_tuple(ba), rtol=1e-6)


def test_reward_normalizer_across_eight_devices_equals_one_device():
    """Under jit with the batch sharded over 8 (simulated) devices, `update` sees the global
    batch; inside shard_map, per-device states merged with `merge` give the same moments."""
    assert jax.device_count() >= 8  # conftest.py simulates 8 CPU devices
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    rng = np.random.default_rng(3)
    rewards = rewards_with_holes(rng, (64,))
    where = rng.random(64) < 0.8
    before = rng.normal(size=16).astype(np.float32)
    previous = update_moments(before, NORMALIZER.init())
    one_device = update_moments(rewards, previous, where=where)
    batch = NamedSharding(mesh, P("data"))
    sharded = update_moments(
        jax.device_put(rewards, batch),
        jax.device_put(previous, NamedSharding(mesh, P())),
        where=jax.device_put(where, batch),
    )
    assert_moments(sharded, state_tuple(one_device), rtol=1e-6)
    assert_moments(sharded, ref_moments(np.concatenate([before, rewards[where]])))

    def local(r, m):
        state = NORMALIZER.update(r, NORMALIZER.init(), where=m)
        gathered = jax.tree.map(lambda x: jax.lax.all_gather(x, "data"), state)
        merged = NORMALIZER.init()
        for device in range(8):
            merged = NORMALIZER.merge(merged, jax.tree.map(lambda x, d=device: x[d], gathered))
        return jax.tree.map(lambda x: x[None], merged)  # each device's merged state

    per_device = jax.jit(
        jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"))
    )(rewards, where)
    assert per_device.count.shape == (8,)
    for device in range(8):
        merged = jax.tree.map(lambda x, d=device: x[d], per_device)
        assert_moments(merged, ref_moments(rewards, where))
        assert_moments(NORMALIZER.merge(previous, merged), state_tuple(one_device), rtol=1e-6)


# ---- jit, scan, vmap, grad, dtypes, recompilation -----------------------------------------------


def test_no_recompilation_when_numeric_hyperparameters_change():
    rng = np.random.default_rng(4)
    kls = rng.uniform(0.0, 10.0, STEPS).astype(np.float32)
    n_steps = np.full(STEPS, 512, np.int32)
    assert_traced_once(
        kl_trajectory,
        [
            (
                (kls, n_steps, all_valid((STEPS,)), jnp.float32(c), jnp.float32(t), jnp.float32(h)),
                {},
            )
            for c, t, h in ((0.2, 6.0, 1e4), (0.05, 1.0, 100.0))
        ],
    )
    entropies = rng.uniform(0.0, 1.0, STEPS).astype(np.float32)
    for rule in ("additive", "log"):
        assert_traced_once(
            lambda *args, rule=rule: entropy_trajectory(*args, rule=rule),
            [
                ((entropies, all_valid((STEPS,)), *map(jnp.float32, values)), {})
                for values in ((0.2, 1e-4, 0.01, 0.0, 0.005), (0.5, 0.1, 0.02, 1e-3, 0.1))
            ],
        )
    kl_logps, ref = kto_batches(rng, all_valid())
    for average in ("ema", "mean"):
        assert_traced_once(
            lambda *args, average=average: kto_trajectory(*args, average=average),
            [((kl_logps, ref, all_valid(), jnp.float32(d)), {}) for d in (0.9, 0.5)],
        )

    def normalize(rewards, eps):
        normalizer = advantages.reward_normalizer(eps=eps)
        return normalizer.normalize(rewards, normalizer.update(rewards, normalizer.init()))

    assert_traced_once(normalize, [((kls, jnp.float32(e)), {}) for e in (1e-8, 0.5)])
    fixed = advantages.fixed_kl_controller
    assert_traced_once(
        lambda c: fixed(kl_coef=c).update(1.0, fixed(kl_coef=c).init(), n_steps=8).kl_coef,
        [((jnp.float32(c),), {}) for c in (0.1, 0.2)],
    )


def test_vmap_runs_independent_controllers():
    # One KL controller per target, and one normaliser per reward stream, side by side.
    targets = jnp.array([1.0, 4.0, 9.0])
    kls = np.array([[3.0, 5.0, 2.0]] * STEPS, np.float32)
    n_steps = np.full(STEPS, 1000, np.int32)
    per_target = jax.jit(jax.vmap(kl_trajectory, in_axes=(None, None, None, None, 0, None)))(
        kls[:, 0], n_steps, all_valid((STEPS,)), 0.1, targets, 1e4
    )
    for k, target in enumerate(np.asarray(targets)):
        expected = ref_kl_coefs(kls[:, 0], n_steps, init=0.1, target=target, horizon=1e4)
        assert_close(per_target[k], expected, rtol=1e-6, atol=0)
    rng = np.random.default_rng(5)
    streams = rewards_with_holes(rng, (3, STEPS, B))
    states = jax.jit(jax.vmap(moments_trajectory, in_axes=(0, None)))(streams, all_valid())
    for k in range(3):
        assert_moments(jax.tree.map(lambda x, k=k: x[k, -1], states), ref_moments(streams[k]))


def test_low_precision_inputs_are_close_to_float32():
    rng = np.random.default_rng(6)
    kls = jnp.asarray(rng.uniform(3.0, 9.0, STEPS), jnp.float32)
    n_steps = np.full(STEPS, 512, np.int32)
    full = kl_steps(kls, n_steps, all_valid((STEPS,)), 0.2, 6.0, 1e4)
    low = kl_steps(kls.astype(jnp.bfloat16), n_steps, all_valid((STEPS,)), 0.2, 6.0, 1e4)
    assert low.dtype == jnp.float32
    # bf16 rounds the KL by up to 2^-9 relative, which moves e by up to 0.003 here and each
    # step's factor by 0.003 n / H = 1.5e-4: 1e-3 over 6 steps.
    assert_close(low, full, rtol=1e-3)
    rewards = jnp.asarray(rng.normal(1.0, 2.0, (STEPS, B)), jnp.float32)
    states = moments_steps(rewards, all_valid())
    states_bf16 = moments_steps(rewards.astype(jnp.bfloat16), all_valid())
    assert states_bf16.mean.dtype == jnp.float32
    assert_close(states_bf16.mean, states.mean, rtol=0.02, atol=0.02)
    assert_close(states_bf16.m2, states.m2, rtol=0.02)
    last = jax.tree.map(lambda x: x[-1], states)
    normalized = NORMALIZER.normalize(rewards[0].astype(jnp.bfloat16), last)
    assert normalized.dtype == jnp.float32
    assert_close(normalized, NORMALIZER.normalize(rewards[0], last), rtol=0.02, atol=0.02)


def test_normalize_gradient_is_finite_and_zero_at_masked_or_nan_rewards():
    state = update_moments(np.array([1.0, 4.0, 2.0, 7.0], np.float32), NORMALIZER.init())
    rewards = jnp.array([1.0, jnp.nan, jnp.inf, 3.0, -jnp.inf])
    where = jnp.array([True, True, True, True, False])
    grad = jax.jit(jax.grad(lambda r: jnp.sum(NORMALIZER.normalize(r, state, where=where))))(
        rewards
    )
    std = math.sqrt(ref_moments([1.0, 4.0, 2.0, 7.0])[2] / 3)
    assert_close(grad, [1 / (std + 1e-8), 0.0, 0.0, 1 / (std + 1e-8), 0.0], rtol=1e-6)


def test_float64_inputs():
    with jax.enable_x64(True):
        rewards = np.random.default_rng(7).normal(size=B)
        state = NORMALIZER.update(rewards, NORMALIZER.init())
        assert state.mean.dtype == jnp.float32  # the state stays float32
        out = NORMALIZER.normalize(rewards, state)
        assert out.dtype == jnp.float64
        assert_close(out, ref_normalize(rewards, ref_moments(rewards)), rtol=1e-6)
        controller = advantages.adaptive_kl_controller(init_kl_coef=0.1, target_kl=1.0)
        state = controller.update(np.float64(2.0), controller.init(), n_steps=100)
        assert state.kl_coef.dtype == jnp.float32
        assert_close(state.kl_coef, 0.1 * (1 + 0.2 * 0.01), rtol=1e-7)


# ---- errors -------------------------------------------------------------------------------------


def test_errors_name_the_argument():
    with raises_naming("target_kl", error=ValueError):
        advantages.adaptive_kl_controller(init_kl_coef=0.1, target_kl=0.0)
    with raises_naming("horizon", error=ValueError):
        advantages.adaptive_kl_controller(init_kl_coef=0.1, target_kl=1.0, horizon=-1)
    with raises_naming("init_kl_coef", error=ValueError):
        advantages.adaptive_kl_controller(init_kl_coef=-0.1, target_kl=1.0)
    with raises_naming("kl_coef", error=ValueError):
        advantages.fixed_kl_controller(kl_coef=-1.0)
    controller = advantages.adaptive_kl_controller(init_kl_coef=0.1, target_kl=1.0)
    with raises_naming("n_steps", error=ValueError):
        controller.update(1.0, controller.init(), n_steps=0)
    with raises_naming("rule"):
        advantages.adaptive_entropy_controller(target_entropy=0.2, rule="sac")
    with raises_naming("init_entropy_weight", "log", error=ValueError):
        advantages.adaptive_entropy_controller(target_entropy=0.2, rule="log")
    with raises_naming("step_size", error=ValueError):
        advantages.adaptive_entropy_controller(target_entropy=0.2, step_size=0.0)
    with raises_naming("max_entropy_weight", "min_entropy_weight", error=ValueError):
        advantages.adaptive_entropy_controller(
            target_entropy=0.2, min_entropy_weight=0.01, max_entropy_weight=0.005
        )
    with raises_naming("average"):
        advantages.running_kto_reference_point(average="median")
    with raises_naming("decay", error=ValueError):
        advantages.running_kto_reference_point(decay=1.5)
    with raises_naming("ddof", error=ValueError):
        advantages.reward_normalizer(ddof=2)
    with raises_naming("eps", error=ValueError):
        advantages.reward_normalizer(eps=-1.0)
    with raises_naming("center", error=TypeError):
        advantages.reward_normalizer(center=1)
    entropy = advantages.adaptive_entropy_controller(target_entropy=0.2)
    kto = advantages.running_kto_reference_point()
    with own_checks():
        with raises_naming("where", "(3,)", "(2,)", error=ValueError):
            controller.update(jnp.ones(2), controller.init(), n_steps=8, where=jnp.ones(3, bool))
        with raises_naming("kl", error=TypeError):
            controller.update(jnp.ones(2, bool), controller.init(), n_steps=8)
        with raises_naming("entropy", error=TypeError):
            entropy.update(jnp.ones(2, jnp.int32), entropy.init())
        with raises_naming("where", "(2, 3)", "(3, 2)", error=ValueError):
            entropy.update(jnp.ones((3, 2)), entropy.init(), where=jnp.ones((2, 3), bool))
        with raises_naming("ref_kl_logps", "(3,)", "(2,)", error=ValueError):
            kto.update(jnp.ones(2), jnp.ones(3), kto.init())
        with raises_naming("rewards", error=TypeError):
            NORMALIZER.update(jnp.ones(3, bool), NORMALIZER.init())
        with raises_naming("where", error=ValueError):
            NORMALIZER.normalize(jnp.ones(3), NORMALIZER.init(), where=jnp.ones(4, bool))
        with raises_naming("where", error=ValueError):  # an integer mask of other values
            NORMALIZER.update(jnp.ones(3), NORMALIZER.init(), where=jnp.array([0, 1, 2]))
