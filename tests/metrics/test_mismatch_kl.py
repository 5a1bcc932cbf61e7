"""Mismatch KL between the trainer's and the sampler's log-probs (tunelib/metrics/_mismatch.py)."""

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
from tunelib import metrics

mismatch_kl = jax.jit(metrics.mismatch_kl, static_argnames="estimator")


def ref_mismatch_kl(logps, sampler_logps, where, estimator):
    """KL(sampler || trainer) estimates from x = log pi_trainer - log pi_sampler, float64."""
    with np.errstate(invalid="ignore"):  # -inf - -inf under the mask
        x = np.asarray(logps, np.float64) - np.asarray(sampler_logps, np.float64)
    per_token = -x if estimator == "k1" else np.expm1(x) - x
    per_token = np.where(where, per_token, 0.0)
    valid = per_token[where]
    mean, high = (valid.mean(), valid.max()) if valid.size else (0.0, 0.0)
    return per_token, mean, high


@given(
    float_arrays((3, 5), -20.0, 0.0),
    float_arrays((3, 5), -2.0, 2.0),
    bool_arrays((3, 5)),
    st.sampled_from(["k1", "k3"]),
)
def test_matches_reference(logps, shift, where, estimator):
    sampler = (logps + shift).astype(np.float32)
    out = mismatch_kl(logps, sampler, estimator=estimator, where=where)
    assert out.per_token.shape == (3, 5)
    assert all(x.dtype == jnp.float32 for x in out)
    for got, want in zip(out, ref_mismatch_kl(logps, sampler, where, estimator), strict=True):
        assert_close(got, want, rtol=1e-5, atol=1e-6)
    if estimator == "k3":
        assert np.all(np.asarray(out.per_token) >= 0)


def test_accurate_at_small_mismatches():
    # Log-ratios of 1e-7 to 1e-2, what float32 samplers and trainers reach: k3 ~ x^2 / 2
    # to float32's precision, where expm1(x) - x would be rounding error.
    x = np.array([[1e-7, -3e-7, 1e-6, -4e-5, 2e-3, -1e-2, 0.5, -0.5, 0.7]], np.float32)
    out = mismatch_kl(x, np.zeros_like(x))
    exact = np.expm1(x.astype(np.float64)) - x.astype(np.float64)
    assert_close(out.per_token, exact, rtol=2e-6, atol=0)
    with jax.enable_x64(True):
        exact64 = np.array([1e-7, -3e-7, 1e-6, -4e-5, 0.3, -0.5, 0.5, 0.51])
        series = sum(exact64**j / np.prod(np.arange(1.0, j + 1)) for j in range(2, 40))
        out64 = mismatch_kl(exact64[None], np.zeros((1, 8)))
        assert out64.mean.dtype == jnp.float64
        assert_close(out64.per_token[0], series, rtol=1e-14, atol=0)


def test_masks_gradients_dtypes_and_no_retrace():
    logps = np.log(np.array([[0.5, 0.9, 0.2, np.nan], [0.3, 0.3, 1.0, 1.0]], np.float32))
    sampler = np.log(np.array([[0.5, 0.8, 0.25, 0.1], [0.6, 0.3, 1.0, 0.5]], np.float32))
    logps[1, 2:] = sampler[1, 2] = -np.inf  # masked: ignored, gradient 0
    where = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.int32)
    out = mismatch_kl(logps, sampler, where=where)
    ref = ref_mismatch_kl(logps, sampler, where.astype(bool), "k3")
    for got, want in zip(out, ref, strict=True):
        assert_close(got, want, rtol=1e-6)
    empty = mismatch_kl(logps, sampler, where=np.zeros_like(where))
    assert float(empty.mean) == float(empty.max) == 0.0
    assert np.all(np.asarray(empty.per_token) == 0)
    # d mean(k3) / d log pi_trainer = (r - 1) / N; d mean(k1) = -1 / N; 0 where masked.
    ratio = np.exp(np.where(where, np.nan_to_num(logps) - np.nan_to_num(sampler), 0.0))
    for estimator, want in (("k3", (ratio - 1) / 5), ("k1", -np.ones_like(ratio) / 5)):
        grad = jax.grad(
            lambda lp, e=estimator: metrics.mismatch_kl(lp, sampler, estimator=e, where=where).mean
        )(logps)
        assert_close(grad, np.where(where, want, 0.0), rtol=1e-5, atol=1e-7)
    low = mismatch_kl(
        jnp.asarray(logps, jnp.bfloat16), jnp.asarray(sampler, jnp.bfloat16), where=where
    )
    assert low.mean.dtype == jnp.float32
    assert_close(low.mean, out.mean, rtol=0.1, atol=2e-3)
    # The clamp keeps k3 finite however far apart the two are.
    far = mismatch_kl(np.array([[0.0]], np.float32), np.array([[-200.0]], np.float32))
    assert_close(far.max, np.expm1(20.0) - 20.0, rtol=1e-6)
    assert_traced_once(
        metrics.mismatch_kl,
        [
            ((logps, sampler + s), {"log_ratio_clamp": jnp.float32(c), "where": where})
            for s, c in ((0.0, 20.0), (0.1, 5.0))
        ],
    )


def test_errors_name_the_argument():
    logps = np.zeros((2, 3), np.float32)
    with raises_naming("log_ratio_clamp", error=ValueError):
        metrics.mismatch_kl(logps, logps, log_ratio_clamp=0.0)
    with own_checks():
        with raises_naming("estimator", "k2", error=ValueError):
            metrics.mismatch_kl(logps, logps, estimator="k2")
        with raises_naming("sampler_token_logps", "(2, 2)", error=ValueError):
            metrics.mismatch_kl(logps, logps[:, :2])
        with raises_naming("token_logps", "[B, T]", error=ValueError):
            metrics.mismatch_kl(logps[0], logps[0])
        with raises_naming("sampler_token_logps", error=TypeError):
            metrics.mismatch_kl(logps, logps.astype(np.int32))
        with raises_naming("where", error=ValueError):
            metrics.mismatch_kl(logps, logps, where=np.ones((3, 2), bool))
