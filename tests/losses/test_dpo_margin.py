import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_close, float_arrays, own_checks, raises_naming
from tests.losses import _preference_refs as ref
from tunelib import losses

B = 4
pairs = st.tuples(*[float_arrays((B,), -30.0, 0.0)] * 4)
betas = st.floats(0.05, 2.0)


def with_margin(h):
    """Inputs whose DPO margin is exactly `h`."""
    h = jnp.asarray(h, jnp.float32)
    zeros = jnp.zeros_like(h)
    return h, zeros, zeros, zeros


def of_margin(fn, **hyper):
    """`fn` as a jitted function of the margin alone, and its elementwise derivative."""
    value = jax.jit(lambda h: fn(*with_margin(h), **hyper))
    derivative = jax.jit(jax.grad(lambda h: fn(*with_margin(h), **hyper).sum()))
    return value, derivative


ipo_loss = jax.jit(losses.ipo_loss)
hinge_loss = jax.jit(losses.hinge_loss)
exo_loss = jax.jit(losses.exo_loss)
discopop_loss = jax.jit(losses.discopop_loss)


@given(pairs, betas)
def test_ipo_is_the_squared_distance_to_its_target(pair, beta):
    loss = np.asarray(ipo_loss(*pair, beta=beta))
    assert np.all(loss >= 0)
    assert_close(np.sqrt(loss), np.abs(ref.margin(*pair) - 1 / (2 * beta)), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_ipo_is_minimised_at_half_inverse_beta(beta):
    target = 1 / (2 * beta)
    value, derivative = of_margin(losses.ipo_loss, beta=beta)
    h = np.array([target - 1, target, target + 1], np.float32)
    assert_close(value(h), [1.0, 0.0, 1.0], atol=1e-6)
    assert_close(derivative(h), [-2.0, 0.0, 2.0], atol=1e-5)


@given(pairs, betas)
def test_hinge_is_zero_past_the_margin_and_linear_before(pair, beta):
    x = beta * ref.margin(*pair)
    loss = np.asarray(hinge_loss(*pair, beta=beta))
    assert np.all(loss >= 0)
    assert np.all(loss[x >= 1 + 1e-4] == 0)
    inside = x < 1 - 1e-4
    assert_close(loss[inside], 1 - x[inside], rtol=1e-4, atol=1e-4)


def test_hinge_is_slic_without_reference():
    # SLiC: max(0, delta - log p(y_w) + log p(y_l)) = delta * hinge with beta = 1 / delta.
    delta = 2.0
    chosen, rejected = (
        np.array([-3.0, -5.0, -1.0], np.float32),
        np.array([-4.0, -4.0, -6.0], np.float32),
    )
    zeros = np.zeros(3, np.float32)
    slic = np.maximum(0.0, delta - chosen + rejected)
    assert_close(delta * hinge_loss(chosen, rejected, zeros, zeros, beta=1 / delta), slic)


@given(pairs, betas, st.floats(1e-4, 0.5))
def test_exo_is_a_kl_divergence(pair, beta, epsilon):
    loss = np.asarray(exo_loss(*pair, beta=beta, epsilon=epsilon))
    assert np.all(loss >= -1e-6)
    # KL = cross-entropy against the labels (1 - eps, eps) minus the model's own entropy.
    x = beta * ref.margin(*pair)
    p = ref.sigmoid(x)
    cross_entropy = -p * np.log1p(-epsilon) - (1 - p) * np.log(epsilon)
    entropy = -p * ref.log_sigmoid(x) - (1 - p) * ref.log_sigmoid(-x)
    assert_close(loss, cross_entropy - entropy, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("epsilon", [1e-3, 0.1, 0.4])
def test_exo_vanishes_where_the_model_matches_the_labels(epsilon):
    beta = 0.5
    best = np.log((1 - epsilon) / epsilon) / beta
    value, derivative = of_margin(losses.exo_loss, beta=beta, epsilon=epsilon)
    h = np.array([best - 1, best, best + 1], np.float32)
    loss = np.asarray(value(h))
    assert abs(loss[1]) < 1e-6 and loss[0] > 1e-5 and loss[2] > 1e-5
    assert abs(float(derivative(h)[1])) < 1e-5


@given(float_arrays((B,), -200.0, 200.0), st.floats(0.01, 1.0), st.floats(0.02, 0.5))
def test_discopop_blends_logistic_and_exponential(h, beta, tau):
    loss = np.asarray(discopop_loss(*with_margin(h), beta=beta, tau=tau), np.float64)
    rho = beta * h.astype(np.float64)
    assert np.all(loss >= 0)
    # Far on either side of the gate it is one of its two components.
    exponential, logistic = rho / tau > 30, rho / tau < -30
    assert_close(loss[exponential], np.exp(-rho[exponential]), rtol=1e-4, atol=1e-6)
    assert_close(loss[logistic], -ref.log_sigmoid(rho[logistic]), rtol=1e-4, atol=1e-6)
    # At rho = 0 the gate is 1/2: (log 2 + 1) / 2.
    assert_close(
        discopop_loss(*with_margin(np.zeros(1)), beta=beta, tau=tau), [(np.log(2) + 1) / 2]
    )


def test_discopop_very_negative_margin_has_no_inf_times_zero():
    value, derivative = of_margin(losses.discopop_loss, beta=0.05, tau=0.05)
    h = np.array([-4e4, -1e3, 1e3, 4e4], np.float32)
    loss, grad = np.asarray(value(h)), np.asarray(derivative(h))
    assert np.all(np.isfinite(loss)) and np.all(np.isfinite(grad))
    assert_close(loss[:2], -0.05 * h[:2], rtol=1e-6)  # -log sigmoid(rho) = -rho there
    assert_close(grad[:2], [-0.05, -0.05], rtol=1e-5)
    assert_close(loss[2:], np.exp(-0.05 * h[2:].astype(np.float64)), rtol=1e-4, atol=0)
    assert_close(grad[2:], -0.05 * np.exp(-0.05 * h[2:].astype(np.float64)), rtol=1e-4, atol=0)


def test_hyperparameter_errors():
    pair = [jnp.zeros(3)] * 4
    with own_checks():
        for fn in (losses.ipo_loss, losses.hinge_loss, losses.exo_loss, losses.discopop_loss):
            with raises_naming("beta", error=ValueError):
                fn(*pair, beta=0.0)
        for epsilon in (0.0, 1.0):
            with raises_naming("epsilon", "(0, 1)", error=ValueError):
                losses.exo_loss(*pair, epsilon=epsilon)
        with raises_naming("tau", error=ValueError):
            losses.discopop_loss(*pair, tau=-0.1)
