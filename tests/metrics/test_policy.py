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
from tests.losses import _rl_refs as ref
from tunelib import losses, metrics


def ref_ratios(logps, old, where, level="token"):
    """The valid tokens' ratios, row by row, concatenated."""
    parts = [ref.ratio(lp, o, level) for lp, o in ref.rows(where, logps, old) if lp.size]
    return np.concatenate(parts) if parts else np.zeros(0)


def ref_clip_fractions(
    logps, old, adv, where, level="token", epsilon_low=0.2, epsilon_high=0.2, dual_clip=None
):
    """(low, high, region, clipped, dual, low_min, high_max) from the valid tokens, row by row."""
    per_row = []
    for lp, o, a in ref.rows(where, logps, old, adv):
        if lp.size == 0:
            continue
        r = ref.ratio(lp, o, level)
        below, above = r < 1 - epsilon_low, r > 1 + epsilon_high
        dual = (a < 0) & (r > dual_clip) if dual_clip is not None else np.zeros(r.shape, bool)
        per_row.append((below & (a < 0), above & (a > 0), below | above, dual))
    if not per_row:
        return (0.0,) * 7
    low, high, region, dual = (np.concatenate(parts) for parts in zip(*per_row, strict=True))
    return (
        low.mean(),
        high.mean(),
        region.mean(),
        (low | high).mean(),
        dual.mean(),
        min(row[0].mean() for row in per_row),
        max(row[1].mean() for row in per_row),
    )


def ref_approx_kl(logps, old, where):
    log_r = np.concatenate([np.zeros(0)] + [lp - o for lp, o in ref.rows(where, logps, old)])
    if log_r.size == 0:
        return 0.0, 0.0, 0.0
    return (-log_r).mean(), (0.5 * log_r**2).mean(), (np.exp(log_r) - 1 - log_r).mean()


def ref_ratio_statistics(logps, old, where, level="token"):
    r = ref_ratios(logps, old, where, level)
    if r.size == 0:
        return (0.0, 0.0, 0.0, 0.0)
    return (r.mean(), r.min(), r.max(), np.abs(np.log(r)).mean())


clip_fractions = jax.jit(metrics.clip_fractions, static_argnames="level")
clip_masks = jax.jit(metrics.clip_masks, static_argnames="level")
approx_kl = jax.jit(metrics.approx_kl)
ratio_statistics = jax.jit(metrics.ratio_statistics, static_argnames="level")


@st.composite
def problems(draw):
    # A few shapes only: each one compiles every jitted diagnostic again.
    b, t = draw(st.sampled_from([(1, 1), (2, 3), (3, 4)]))
    logps = draw(float_arrays((b, t), -8.0, 0.0))
    old = (logps + draw(float_arrays((b, t), -1.0, 1.0))).astype(np.float32)
    adv = draw(float_arrays((b,) if draw(st.booleans()) else (b, t), -3.0, 3.0))
    return logps, old, adv, draw(bool_arrays((b, t)))


def with_nan(x, where):
    mask = where if x.ndim == 2 else where.any(-1)
    return np.where(mask, x, np.nan).astype(np.float32)


@pytest.mark.parametrize("level", losses.RATIO_LEVELS)
@given(problems(), st.floats(0.0, 0.5), st.floats(0.0, 0.5))
def test_match_reference_and_ignore_masked_tokens(level, problem, eps_low, eps_high):
    logps, old, adv, where = problem
    nan = [with_nan(x, where) for x in (logps, old, adv)]
    eps = {"epsilon_low": eps_low, "epsilon_high": eps_high}
    # A ratio within rounding of a clip bound may fall on either side in float32 and float64:
    # leave such tokens (at the sequence levels, such rows) out of the clip-fraction check.
    r = ref.per_token(lambda lp, o: ref.ratio(lp, o, level), where, logps, old)
    on_bound = np.isclose(r, 1 - eps_low, rtol=1e-5) | np.isclose(r, 1 + eps_high, rtol=1e-5)
    on_bound |= np.isclose(r, 1.5, rtol=1e-5)  # the dual-clip bound
    if level != "token":
        on_bound = np.broadcast_to(on_bound.any(-1, keepdims=True), where.shape)
    decided = where & ~on_bound
    fractions = clip_fractions(*nan, level=level, **eps, dual_clip=1.5, where=decided)
    expected = ref_clip_fractions(logps, old, adv, decided, level, eps_low, eps_high, 1.5)
    assert_close(np.array(fractions), expected, atol=1e-6)
    stats = ratio_statistics(*nan[:2], level=level, where=where)
    assert_close(np.array(stats), ref_ratio_statistics(logps, old, where, level), rtol=1e-5)
    if level == "token":
        kl = approx_kl(*nan[:2], where=where)
        assert_close(np.array(kl), ref_approx_kl(logps, old, where), rtol=1e-4, atol=1e-6)


@given(problems(), st.floats(0.0, 0.5), st.floats(0.0, 0.5))
def test_properties(problem, eps_low, eps_high):
    logps, old, adv, where = problem
    eps = {"epsilon_low": eps_low, "epsilon_high": eps_high}
    out = clip_fractions(logps, old, adv, **eps, dual_clip=1.5, where=where)
    low, high, region, clipped, dual, low_min, high_max = np.array(out, np.float64)
    # Both sides are disjoint parts of the region, and all are fractions.
    assert 0 <= low <= 1 and 0 <= high <= 1 and low + high <= region + 1e-6 <= 1 + 1e-6
    assert clipped == pytest.approx(low + high, abs=1e-6)
    # The dual clip binds only above 1.5 > 1 + epsilon_high, outside the trust region.
    assert dual <= region + 1e-6
    # A row's fraction lies between the extremes the batch's mean lies between.
    assert 0 <= low_min <= 1 and 0 <= high_max <= 1
    if where.any():
        assert low_min <= low + 1e-6 and high <= high_max + 1e-6
    k1, k2, k3 = np.array(approx_kl(logps, old, where=where), np.float64)
    assert k2 >= 0 and k3 >= 0
    mean, low_r, high_r, abs_log = np.array(ratio_statistics(logps, old, where=where), np.float64)
    assert abs_log >= 0
    if where.any():
        assert low_r <= mean * (1 + 1e-6) and mean <= high_r * (1 + 1e-6)
        # k3 = mean(r - 1) + k1.
        assert k3 - k1 == pytest.approx(mean - 1, abs=1e-5)
    # Identical policies: nothing clipped, no divergence, every ratio 1.
    assert np.array(clip_fractions(logps, logps, adv, where=where)).tolist() == [0] * 7
    assert np.array(approx_kl(logps, logps, where=where)).tolist() == [0, 0, 0]
    expected = [1, 1, 1, 0] if where.any() else [0, 0, 0, 0]
    assert np.array(ratio_statistics(logps, logps, where=where)).tolist() == expected


def test_clip_fractions_count_the_tokens_without_gradient():
    rng = np.random.default_rng(0)
    logps = rng.uniform(-3, 0, (4, 8)).astype(np.float32)
    old = (logps + rng.uniform(-0.5, 0.5, (4, 8))).astype(np.float32)
    adv = rng.normal(size=(4, 8)).astype(np.float32)
    where = rng.random((4, 8)) < 0.8
    kw = {"epsilon_low": 0.2, "epsilon_high": 0.28, "where": where}
    grad = jax.grad(lambda x: jnp.sum(losses.policy_gradient_loss(x, old, adv, **kw)))(logps)
    fractions = metrics.clip_fractions(logps, old, adv, **kw)
    no_gradient = np.sum(np.asarray(grad)[where] == 0) / where.sum()
    assert fractions.low + fractions.high == pytest.approx(no_gradient, abs=1e-6)
    assert fractions.low > 0 and fractions.high > 0 and fractions.region > fractions.low


def test_fixed_values_and_empty_batch():
    logps = np.log([[0.5, 0.9, 0.2, 0.9], [0.1, 0.1, 0.1, 0.1]]).astype(np.float32)
    old = np.log([[0.5, 0.5, 0.5, 0.5], [0.3, 0.3, 0.3, 0.3]]).astype(np.float32)
    adv = np.array([[1.0, 1.0, -1.0, -1.0], [1.0, 1.0, 1.0, 1.0]], np.float32)
    where = np.array([[True] * 4, [False] * 4])
    out = metrics.clip_fractions(logps, old, adv, dual_clip=1.5, where=where)
    # The ratio 1.8 with A < 0 is outside the region but not clipped; the dual clip binds it.
    assert_close(np.array(out), [0.25, 0.25, 0.75, 0.5, 0.25, 0.25, 0.25])
    seq = metrics.clip_fractions(logps, old, adv, level="sequence", where=where)
    # Sequence ratio: the geometric mean of 1, 1.8, 0.4, 1.8 is 1.067, inside [0.8, 1.2].
    assert_close(np.array(seq), [0.0] * 7)
    stats = metrics.ratio_statistics(logps, old, where=where)
    log_r = np.log([1.0, 1.8, 0.4, 1.8])
    expected = [(1 + 1.8 + 0.4 + 1.8) / 4, 0.4, 1.8, np.abs(log_r).mean()]
    assert_close(np.array(stats), expected, rtol=1e-6)
    seq_stats = metrics.ratio_statistics(logps, old, level="sequence", where=where)
    assert_close(np.array(seq_stats), [np.exp(log_r.mean())] * 3 + [log_r.mean()], rtol=1e-6)
    kl = metrics.approx_kl(logps, old, where=where)
    log_r = np.log([1.0, 1.8, 0.4, 1.8])
    assert_close(
        np.array(kl),
        [-log_r.mean(), (0.5 * log_r**2).mean(), (np.exp(log_r) - 1 - log_r).mean()],
        rtol=1e-5,
    )
    nan = np.full((2, 4), np.nan, np.float32)
    nothing = np.zeros((2, 4), bool)
    for result in (
        metrics.clip_fractions(nan, nan, nan, dual_clip=2.0, where=nothing),
        metrics.approx_kl(nan, nan, where=nothing),
        metrics.ratio_statistics(nan, nan, where=nothing),
    ):
        assert set(np.array(result).tolist()) == {0}
    masks = metrics.clip_masks(nan, nan, nan, dual_clip=2.0, where=nothing)
    assert not np.any(np.array(masks))


def test_k3_clamp_keeps_the_estimate_finite_and_non_negative():
    logps = np.array([[0.0, -100.0]], np.float32)
    old = np.array([[-100.0, 0.0]], np.float32)
    k1, k2, k3 = np.array(metrics.approx_kl(logps, old, log_ratio_clamp=20.0), np.float64)
    assert k1 == 0 and k2 == pytest.approx(5000)
    assert k3 == pytest.approx(((np.exp(20) - 21) + (np.exp(-20) - 1 + 20)) / 2, rel=1e-6)


def test_dtypes_jit_vmap_and_no_retrace():
    rng = np.random.default_rng(1)
    logps = rng.uniform(-3, 0, (3, 2, 5)).astype(np.float32)
    old = (logps + rng.uniform(-0.5, 0.5, (3, 2, 5))).astype(np.float32)
    adv = rng.normal(size=(3, 2)).astype(np.float32)
    where = rng.random((3, 2, 5)) < 0.7
    fns = [
        lambda lp, o, a, w, e: metrics.clip_fractions(
            lp, o, a, epsilon_high=e, dual_clip=e + 1.1, where=w
        ),
        lambda lp, o, a, w, e: tuple(
            m.astype(jnp.promote_types(lp.dtype, jnp.float32))
            for m in metrics.clip_masks(lp, o, a, epsilon_low=e, dual_clip=e + 1.1, where=w)
        ),
        lambda lp, o, a, w, e: metrics.approx_kl(lp, o, log_ratio_clamp=e + 10, where=w),
        lambda lp, o, a, w, e: metrics.ratio_statistics(lp, o, log_ratio_clamp=e + 10, where=w),
    ]
    for fn in fns:
        mapped = jax.vmap(fn, in_axes=(0, 0, 0, 0, None))(logps, old, adv, where, 0.2)
        for i in range(3):
            single = fn(logps[i], old[i], adv[i], where[i], 0.2)
            assert_close(np.array(mapped)[:, i], np.array(single), rtol=1e-6)
        assert_traced_once(
            fn, [((logps[0], old[0], adv[0], where[0], jnp.float32(e)), {}) for e in (0.1, 0.3)]
        )
        low = fn(*(x[0].astype(jnp.bfloat16) for x in (logps, old, adv)), where[0], 0.2)
        assert all(x.dtype == jnp.float32 for x in low)
        # bf16 rounding moves a log-ratio by at most 2^-7: ratios and KLs move by ~1 %.
        full = fn(logps[0], old[0], adv[0], where[0], 0.2)
        assert_close(np.array(low), np.array(full), rtol=0.05, atol=0.05)
        with jax.enable_x64(True):
            wide = fn(*(jnp.asarray(x[0], jnp.float64) for x in (logps, old, adv)), where[0], 0.2)
            assert all(x.dtype == jnp.float64 for x in wide)


def test_errors():
    x = np.zeros((2, 3), np.float32)
    adv = np.zeros(2, np.float32)
    with raises_naming("old_token_logps"):
        metrics.approx_kl(x, np.zeros((2, 4), np.float32))
    with raises_naming("level"):
        metrics.ratio_statistics(x, x, level="geometric")
    with own_checks():
        with raises_naming("advantages", "(3,)", "(2,)", "(2, 3)", error=ValueError):
            metrics.clip_fractions(x, x, np.zeros(3, np.float32))
        with raises_naming("old_token_logps", "(2, 4)", error=ValueError):
            metrics.ratio_statistics(x, np.zeros((2, 4), np.float32))
        with raises_naming("where", error=TypeError):
            metrics.approx_kl(x, x, where=np.ones((2, 3), np.float32))
        with raises_naming("where", "2", error=ValueError):
            metrics.ratio_statistics(x, x, where=np.full((2, 3), 2, np.int32))
        with raises_naming("epsilon_low", error=ValueError):
            metrics.clip_fractions(x, x, adv, epsilon_low=-1.0)
        with raises_naming("dual_clip", error=ValueError):
            metrics.clip_masks(x, x, adv, dual_clip=1.0)
        with raises_naming("level", error=ValueError):
            metrics.clip_masks(x, x, adv, level="geometric")
        with raises_naming("log_ratio_clamp", error=ValueError):
            metrics.approx_kl(x, x, log_ratio_clamp=0.0)


def test_integer_masks_count_like_boolean_masks():
    rng = np.random.default_rng(2)
    logps = rng.uniform(-3, 0, (2, 5)).astype(np.float32)
    old = (logps + rng.uniform(-0.5, 0.5, (2, 5))).astype(np.float32)
    adv = rng.normal(size=(2,)).astype(np.float32)
    where = rng.random((2, 5)) < 0.6
    for boolean, integer in (
        (
            metrics.clip_fractions(logps, old, adv, where=where),
            metrics.clip_fractions(logps, old, adv, where=where.astype(np.int32)),
        ),
        (
            metrics.clip_masks(logps, old, adv, where=where),
            metrics.clip_masks(logps, old, adv, where=where.astype(np.int8)),
        ),
        (
            metrics.approx_kl(logps, old, where=where),
            metrics.approx_kl(logps, old, where=where.astype(np.uint8)),
        ),
        (
            metrics.ratio_statistics(logps, old, where=where),
            metrics.ratio_statistics(logps, old, where=where.astype(np.int64)),
        ),
    ):
        np.testing.assert_array_equal(np.array(integer), np.array(boolean))


# ---------------------------------------------------------------------------------------------
# The clip metrics TRL and Tunix log, transcribed in float64 from their code.


def trl_clip_metrics(logps, old, adv, mask, epsilon_low, epsilon_high):
    """TRL 1.16's `clip_ratio/*` of `GRPOTrainer._compute_loss` (token level, one process)."""
    logps, old = np.asarray(logps, np.float64), np.asarray(old, np.float64)
    mask = np.asarray(mask, np.float64)
    adv = np.asarray(adv, np.float64)
    adv = adv[:, None] if adv.ndim == 1 else adv
    coef_1 = np.exp(logps - old)
    low = ((coef_1 < 1 - epsilon_low) & (adv < 0)).astype(np.float64)
    high = ((coef_1 > 1 + epsilon_high) & (adv > 0)).astype(np.float64)
    region = np.maximum(low, high)

    def global_masked_mean(x):
        return (x * mask).sum() / max(mask.sum(), 1.0)

    with np.errstate(invalid="ignore"):
        seq_low = (low * mask).sum(-1) / mask.sum(-1)  # NaN for an empty row
        seq_high = (high * mask).sum(-1) / mask.sum(-1)
    out = {
        "low_mean": global_masked_mean(low),
        "high_mean": global_masked_mean(high),
        "region_mean": global_masked_mean(region),
    }
    if mask.any():  # nanmin / nanmax of only NaN rows are NaN
        out |= {"low_min": np.nanmin(seq_low), "high_max": np.nanmax(seq_high)}
    return out


def tunix_masked_mean(x, mask):
    return (x * mask).sum() / (mask.sum() + 1e-8)


def tunix_grpo_metrics(logps, old, adv, mask, epsilon_low, epsilon_high, epsilon_c):
    """Tunix 0.1.7's GRPO loss diagnostics (tunix/rl/algo_core.py, token level)."""
    logps, old = np.asarray(logps, np.float64), np.asarray(old, np.float64)
    mask = np.asarray(mask, np.float64)
    adv = np.asarray(adv, np.float64)
    adv = adv[:, None] if adv.ndim == 1 else adv
    log_ratio = np.clip(logps - old, -20.0, 20.0)
    is_ratio = np.exp(log_ratio)
    pg_loss_1 = -adv * is_ratio
    pg_loss_2 = -adv * np.clip(is_ratio, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = np.maximum(pg_loss_1, pg_loss_2)
    pg_loss_3 = -epsilon_c * adv
    lower = ((per_token_loss > pg_loss_3) & (adv < 0.0)).astype(np.float64)
    adv_tokens = np.broadcast_to(adv, mask.shape)
    return {
        "pg_clipfrac": tunix_masked_mean((pg_loss_2 > pg_loss_1).astype(np.float64), mask),
        "pg_clipfrac_lower": lower,  # per token; Tunix reduces it with the loss's mode
        "log_ratio/abs_mean": tunix_masked_mean(np.abs(log_ratio), mask),
        "advantage/abs_mean": tunix_masked_mean(np.abs(adv_tokens), mask),
        "advantage/nonzero_frac": tunix_masked_mean(
            (np.abs(adv_tokens) > 1e-8).astype(np.float64), mask
        ),
    }


@given(problems(), st.floats(0.0, 0.5), st.floats(0.0, 0.5))
def test_clip_metrics_match_trl_and_tunix(problem, eps_low, eps_high):
    logps, old, adv, where = problem
    adv = np.where(np.abs(adv) < 0.5, 0.0, adv).astype(np.float32)  # some zero advantages
    r = np.exp(logps.astype(np.float64) - old)
    near = [np.isclose(r, b, rtol=1e-5) for b in (1 - eps_low, 1 + eps_high, 1.5)]
    where = where & ~np.logical_or.reduce(near)  # ties with a bound: float32 vs float64
    nan = [with_nan(x, where) for x in (logps, old, adv)]
    kw = {"epsilon_low": eps_low, "epsilon_high": eps_high}
    out = clip_fractions(*nan, **kw, dual_clip=1.5, where=where)
    trl = trl_clip_metrics(logps, old, adv, where, eps_low, eps_high)
    if where.any():
        expected = [trl[k] for k in ("low_mean", "high_mean", "region_mean", "low_min")]
        assert_close([out.low, out.high, out.clipped, out.low_min], expected, atol=1e-6)
        assert_close(out.high_max, trl["high_max"], atol=1e-6)
    tunix = tunix_grpo_metrics(logps, old, adv, where, eps_low, eps_high, 1.5)
    assert_close(out.clipped, tunix["pg_clipfrac"], atol=1e-6)
    # Tunix's lower clip fraction, reduced by its default loss mode (and as a token mean).
    masks = clip_masks(*nan, **kw, dual_clip=1.5, where=where)
    lower = tunix["pg_clipfrac_lower"]
    per_row = [(lower[i] * where[i]).sum() / max(where[i].sum(), 1) for i in range(len(where))]
    seq_mean = sum(per_row) / max(where.any(-1).sum(), 1)
    dual = masks.dual.astype(np.float32)
    assert_close(
        losses.aggregate(dual, mode="seq_mean_token_mean", where=where).mean(),
        seq_mean,
        atol=1e-6,
    )
    assert_close(out.dual, tunix_masked_mean(lower, where), atol=1e-6)
    stats = ratio_statistics(*nan[:2], where=where)
    assert_close(stats.abs_log_mean, tunix["log_ratio/abs_mean"], rtol=1e-5, atol=1e-6)
    tokens = np.broadcast_to(adv[:, None], where.shape) if adv.ndim == 1 else adv
    adv_stats = metrics.advantage_statistics(tokens, atol=1e-8, where=where)
    assert_close(adv_stats.abs_mean, tunix["advantage/abs_mean"], rtol=1e-6, atol=1e-6)
    assert_close(adv_stats.nonzero_fraction, tunix["advantage/nonzero_frac"], atol=1e-6)


def test_trl_sequence_level_clip_fractions_count_rows():
    # At the sequence level TRL averages over rows (an empty row counts, unclipped): the
    # masks reduced per sequence with empty rows counted; tunelib's own fields weigh tokens.
    logps = np.log([[0.9, 0.9, 0.9], [0.5, 0.5, 0.9], [0.5, 0.5, 0.5]]).astype(np.float32)
    old = np.log(np.full((3, 3), 0.5)).astype(np.float32)
    adv = np.array([1.0, 1.0, 1.0], np.float32)
    where = np.array([[True, True, True], [True, False, False], [False, False, False]])
    kw = {"level": "sequence", "where": where}
    masks = metrics.clip_masks(logps, old, adv, **kw)
    # Row 0: ratio 1.8, clipped high; row 1: ratio 1; row 2: empty.
    trl = losses.aggregate(
        masks.high.astype(np.float32),
        mode="seq_mean_token_mean",
        empty_rows="count",
        where=where,
    )
    assert trl.mean() == pytest.approx(1 / 3)
    assert metrics.clip_fractions(logps, old, adv, **kw).high == pytest.approx(3 / 4)
