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
log_ratios = st.tuples(*[float_arrays((B,), -40.0, 40.0)] * 2)
betas = st.floats(0.05, 2.0)


def on_log_ratios(fn):
    """`fn` as a jitted function of the log-ratios (zero reference log-probs), and its gradient."""

    def loss(r_w, r_l, **hyper):
        return fn(r_w, r_l, jnp.zeros_like(r_w), jnp.zeros_like(r_l), **hyper)

    def total(r_w, r_l, **hyper):
        return loss(r_w, r_l, **hyper).sum()

    return jax.jit(loss), jax.jit(jax.grad(total, argnums=(0, 1)))


PER_RESPONSE = (
    losses.nca_loss,
    losses.bco_pair_loss,
    losses.sppo_hard_loss,
    losses.apo_zero_loss,
    losses.apo_down_loss,
)
nca, nca_grad = on_log_ratios(losses.nca_loss)
bco, _ = on_log_ratios(losses.bco_pair_loss)
sppo, sppo_grad = on_log_ratios(losses.sppo_hard_loss)
apo_zero, apo_zero_grad = on_log_ratios(losses.apo_zero_loss)
apo_down, _ = on_log_ratios(losses.apo_down_loss)


def test_each_loss_sees_only_the_log_ratios():
    # The same r_w, r_l from different absolute log-probs give the same loss.
    r_w, r_l = np.array([1.5, -2.0], np.float32), np.array([-0.5, 3.0], np.float32)
    ref_c, ref_r = np.array([-20.0, -7.0], np.float32), np.array([-11.0, -3.0], np.float32)
    for fn in PER_RESPONSE:
        shifted = fn(ref_c + r_w, ref_r + r_l, ref_c, ref_r, beta=0.3)
        assert_close(shifted, fn(r_w, r_l, 0 * r_w, 0 * r_l, beta=0.3), rtol=1e-5, atol=1e-5)


@given(log_ratios, betas)
def test_nca_properties(ratios, beta):
    r_w, r_l = ratios
    loss = np.asarray(nca(r_w, r_l, beta=beta))
    assert np.all(loss >= 0)
    d_w, d_l = (np.asarray(g) for g in nca_grad(r_w, r_l, beta=beta))
    # Rising in the rejected log-ratio; in the chosen one it falls until beta r_w = log 2.
    assert np.all(d_l >= 0)
    assert_close(d_l, 0.5 * beta * ref.sigmoid(beta * r_l), rtol=1e-4, atol=1e-7)
    expected_d_w = beta * (-ref.sigmoid(-beta * r_w) + 0.5 * ref.sigmoid(beta * r_w))
    assert_close(d_w, expected_d_w, rtol=1e-4, atol=1e-6)


def test_nca_chosen_optimum_is_at_log_2():
    best = np.log(2) / 0.5
    w = np.array([best - 1, best, best + 1], np.float32)
    loss = np.asarray(nca(w, np.zeros(3, np.float32), beta=0.5))
    assert loss[1] < loss[0] and loss[1] < loss[2]
    assert abs(float(nca_grad(w, np.zeros(3, np.float32), beta=0.5)[0][1])) < 1e-6


@given(log_ratios, betas, st.floats(-3.0, 3.0))
def test_bco_shift_moves_the_decision_boundary(ratios, beta, delta):
    r_w, r_l = ratios
    loss = np.asarray(bco(r_w, r_l, beta=beta, delta=delta))
    assert np.all(loss >= 0)
    # Shifting both rewards by delta is the same as the shift delta.
    shift = np.float32(delta / beta)
    assert_close(bco(r_w - shift, r_l - shift, beta=beta), loss, rtol=1e-4, atol=1e-4)
    # Symmetric: swapping the classes and mirroring the rewards around delta changes nothing.
    mirror = np.float32(2 * delta / beta)
    mirrored = bco(mirror - r_l, mirror - r_w, beta=beta, delta=delta)
    assert_close(mirrored, loss, rtol=1e-4, atol=1e-4)


def test_bco_delta_may_be_traced_and_differentiated():
    r_w, r_l = np.array([0.5, -1.0], np.float32), np.array([-0.2, 0.4], np.float32)
    grad = jax.grad(lambda d: bco(r_w, r_l, beta=0.5, delta=d).sum())(jnp.float32(0.3))
    x_w, x_l = 0.5 * r_w - 0.3, 0.5 * r_l - 0.3
    expected = np.sum(ref.sigmoid(-x_w) - ref.sigmoid(x_l))  # d/d delta of the two BCE terms
    assert_close(grad, expected, rtol=1e-5)


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_sppo_is_minimised_at_plus_minus_half_inverse_beta(beta):
    half = 1 / (2 * beta)
    r_w = np.array([half, half + 1, half], np.float32)
    r_l = np.array([-half, -half, -half - 2], np.float32)
    assert_close(sppo(r_w, r_l, beta=beta), [0.0, 1.0, 4.0], atol=1e-5)
    d_w, d_l = sppo_grad(r_w, r_l, beta=beta)
    assert_close(d_w, [0.0, 2.0, 0.0], atol=1e-5)
    assert_close(d_l, [0.0, 0.0, -4.0], atol=1e-5)


@given(log_ratios, betas)
def test_apo_zero_raises_chosen_and_lowers_rejected(ratios, beta):
    r_w, r_l = ratios
    loss = np.asarray(apo_zero(r_w, r_l, beta=beta))
    assert np.all((loss >= 0) & (loss <= 2))
    d_w, d_l = (np.asarray(g) for g in apo_zero_grad(r_w, r_l, beta=beta))
    assert np.all(d_w <= 0) and np.all(d_l >= 0)
    assert_close(
        d_w, -beta * ref.sigmoid(beta * r_w) * ref.sigmoid(-beta * r_w), rtol=1e-4, atol=1e-7
    )


@given(log_ratios, betas, st.floats(0.1, 20.0))
def test_apo_down_lowers_both_likelihoods(ratios, beta, step):
    r_w, r_l = ratios
    loss = np.asarray(apo_down(r_w, r_l, beta=beta))
    assert np.all((loss >= 0) & (loss <= 2))
    # Raising both log-ratios together raises the loss; widening the margin lowers it.
    up = np.float32(step)
    assert np.all(np.asarray(apo_down(r_w + up, r_l + up, beta=beta)) >= loss - 1e-6)
    assert np.all(np.asarray(apo_down(r_w, r_l - up, beta=beta)) <= loss + 1e-6)


def test_beta_must_be_positive():
    pair = [jnp.zeros(3)] * 4
    with own_checks():
        for fn in PER_RESPONSE:
            with raises_naming("beta", error=ValueError):
                fn(*pair, beta=-0.1)
