"""Effective sample size of importance weights (tunelib/metrics/_mismatch.py)."""

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
    x64_copies,
)
from tunelib import metrics

effective_sample_size = jax.jit(metrics.effective_sample_size)


def ref_ess(log_weights, where):
    """(sum w)^2 / sum w^2 / N over the kept weights, float64 (weights up to e^20 fit)."""
    w = np.exp(np.asarray(log_weights, np.float64)[np.asarray(where, bool)])
    if w.size == 0 or not np.any(w > 0):
        return 0.0
    return w.sum() ** 2 / (w**2).sum() / w.size


@given(
    st.sampled_from([(7,), (3, 4)]).flatmap(
        lambda shape: st.tuples(float_arrays(shape, -20.0, 20.0), bool_arrays(shape))
    ),
    st.floats(-500.0, 500.0),
)
def test_matches_reference_and_ignores_scale(data, shift):
    log_weights, where = data
    out = effective_sample_size(log_weights, where=where)
    assert out.shape == () and out.dtype == jnp.float32
    want = ref_ess(log_weights, where)
    assert_close(out, want, rtol=1e-5, atol=1e-7)
    # Multiplying every weight by e^shift changes nothing, even past float32's range.
    shifted = effective_sample_size(
        (log_weights + np.float32(shift)).astype(np.float32), where=where
    )
    assert_close(shifted, want, rtol=1e-4, atol=1e-7)
    if where.any():
        assert 1 / where.sum() - 1e-6 <= float(out) <= 1 + 1e-6


def test_fixed_values_masks_and_no_retrace():
    assert effective_sample_size(np.zeros((2, 3), np.float32)) == 1.0
    assert_close(effective_sample_size(np.array([1000.0, 0.0, 0.0, 0.0], np.float32)), 0.25)
    log_weights = np.array([[0.0, np.log(2.0), np.nan], [-np.inf, 0.0, np.inf]], np.float32)
    where = np.array([[1, 1, 0], [1, 1, 0]], np.int32)
    # Weights 1, 2, 0, 1 under the mask: 16 / 6 / 4.
    assert_close(effective_sample_size(log_weights, where=where), 16 / 6 / 4, rtol=1e-6)
    assert effective_sample_size(log_weights, where=np.zeros_like(where)) == 0.0
    assert effective_sample_size(np.full((3,), -np.inf, np.float32)) == 0.0
    low = effective_sample_size(jnp.asarray([0.0, 0.5, -1.0], jnp.bfloat16))
    assert low.dtype == jnp.float32
    assert_close(low, ref_ess(np.array([0.0, 0.5, -1.0]), np.ones(3, bool)), rtol=1e-2)
    grad = jax.grad(lambda lw: metrics.effective_sample_size(lw, where=where))(log_weights)
    assert np.all(np.isfinite(np.asarray(grad))) and np.all(np.asarray(grad)[where == 0] == 0)
    assert_traced_once(
        metrics.effective_sample_size,
        [((log_weights * s,), {"where": where}) for s in (1.0, 2.0)],
    )


def test_gradient_matches_finite_differences():
    (log_weights,) = x64_copies(np.array([0.3, -1.2, 2.0, 0.0, 0.7]))
    where = np.array([True, True, True, False, True])
    with jax.enable_x64(True):
        grad = jax.grad(lambda lw: metrics.effective_sample_size(lw, where=where))(log_weights)
        assert grad.dtype == jnp.float64
        step, numeric = 1e-6, []
        for i in range(log_weights.size):
            up, down = log_weights.copy(), log_weights.copy()
            up[i] += step
            down[i] -= step
            numeric.append((ref_ess(up, where) - ref_ess(down, where)) / (2 * step))
        assert_close(grad, numeric, rtol=1e-6, atol=1e-9)


def test_errors_name_the_argument():
    with own_checks():
        with raises_naming("log_weights", "[B] or [B, T]", error=ValueError):
            metrics.effective_sample_size(np.zeros((2, 3, 4), np.float32))
        with raises_naming("log_weights", error=TypeError):
            metrics.effective_sample_size(np.zeros(3, np.int32))
        with raises_naming("where", "(4,)", "(3,)", error=ValueError):
            metrics.effective_sample_size(np.zeros(3, np.float32), where=np.ones(4, bool))
