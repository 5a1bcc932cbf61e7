"""The DPO family against a reference model.

Its losses on the margin (tunelib/losses/_dpo.py), on each log-ratio (_dpo_anchored.py) and on
the batch's sorted log-ratios (_dpo_aot.py).
"""

import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_close, float_arrays, own_checks, raises_naming
from tests.losses import _preference_refs as ref
from tunelib import losses

dpo_loss = jax.jit(losses.dpo_loss)
dpo_grads = jax.jit(
    jax.grad(
        lambda c, r, rc, rr, beta, eps: losses.dpo_loss(
            c, r, rc, rr, beta=beta, label_smoothing=eps
        ).sum(),
        argnums=(0, 1, 2, 3),
    )
)
robust_dpo_loss = jax.jit(losses.robust_dpo_loss)
length_normalized_dpo_loss = jax.jit(losses.length_normalized_dpo_loss)

B = 4
pairs = st.tuples(*[float_arrays((B,), -30.0, 0.0)] * 4)
betas = st.floats(0.05, 2.0)


def swapped(pair):
    """The same pair with its label flipped: chosen and rejected trade places."""
    chosen, rejected, ref_chosen, ref_rejected = pair
    return rejected, chosen, ref_rejected, ref_chosen


def with_margin(h):
    """Inputs whose DPO margin is exactly `h`."""
    h = jnp.asarray(h, jnp.float32)
    zeros = jnp.zeros_like(h)
    return h, zeros, zeros, zeros


def softplus(x):
    return np.log1p(np.exp(x))  # -log sigmoid(-x)


def test_fixed_values_in_closed_form():
    # h = (-10 + 14) - (-11 + 13) = 2 and h = -1.
    pair = tuple(np.array(x, np.float32) for x in ([-10, -12], [-14, -11], [-11, -12], [-13, -12]))
    assert_close(dpo_loss(*pair, beta=0.5), [softplus(-1.0), softplus(0.5)])
    smoothed = [
        0.9 * softplus(-1.0) + 0.1 * softplus(1.0),
        0.9 * softplus(0.5) + 0.1 * softplus(-0.5),
    ]
    assert_close(dpo_loss(*pair, beta=0.5, label_smoothing=0.1), smoothed)
    # rDPO = -log sigmoid(beta h) - eps / (1 - 2 eps) * beta h.
    assert_close(
        robust_dpo_loss(*pair, beta=0.5, label_smoothing=0.2),
        [softplus(-1.0) - 1 / 3, softplus(0.5) + 0.5 / 3],
    )
    for beta, eps in [(0.1, 0.0), (1.5, 0.3)]:
        assert_close(dpo_loss(*pair, beta=beta, label_smoothing=eps), ref.dpo(*pair, beta, eps))
        assert_close(
            robust_dpo_loss(*pair, beta=beta, label_smoothing=eps), ref.robust_dpo(*pair, beta, eps)
        )


@given(pairs, betas, st.floats(0.0, 10.0))
def test_dpo_properties(pair, beta, step):
    loss = np.asarray(dpo_loss(*pair, beta=beta))
    assert np.all(loss >= 0)
    # log 2 at zero margin: the policy equal to the reference, however likely the completions.
    chosen, rejected, ref_chosen, ref_rejected = pair
    assert_close(dpo_loss(chosen, rejected, chosen, rejected, beta=beta), np.full(B, np.log(2)))
    # Decreasing in the margin: raising the chosen log-prob never raises the loss.
    raised = np.asarray(
        dpo_loss(chosen + np.float32(step), rejected, ref_chosen, ref_rejected, beta=beta)
    )
    assert np.all(raised <= loss + 1e-6)


@given(pairs, betas, st.floats(0.0, 0.5))
def test_gradient_in_closed_form(pair, beta, eps):
    h = ref.margin(*pair)
    grads = dpo_grads(*pair, beta, eps)
    # d/dh of -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h).
    d_h = -beta * ((1 - eps) * ref.sigmoid(-beta * h) - eps * ref.sigmoid(beta * h))
    for grad, sign in zip(grads, (1, -1, -1, 1), strict=True):
        assert_close(grad, sign * d_h, rtol=1e-4, atol=1e-6)


@given(pairs, betas, st.floats(0.0, 0.5))
def test_label_smoothing_is_cross_entropy_against_flipped_labels(pair, beta, eps):
    mixed = (1 - eps) * np.asarray(dpo_loss(*pair, beta=beta), np.float64) + eps * np.asarray(
        dpo_loss(*swapped(pair), beta=beta), np.float64
    )
    assert_close(dpo_loss(*pair, beta=beta, label_smoothing=eps), mixed, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("eps", [0.05, 0.2, 0.5])
def test_conservative_dpo_minimum_is_finite(eps):
    beta = 0.5
    best = np.log((1 - eps) / eps) / beta  # sigmoid(beta h) = 1 - eps
    h = np.array([best - 0.5, best, best + 0.5], np.float32)
    loss = np.asarray(dpo_loss(*with_margin(h), beta=beta, label_smoothing=eps))
    assert loss[1] < loss[0] and loss[1] < loss[2]
    grad = jax.grad(
        lambda x: losses.dpo_loss(*with_margin(x), beta=beta, label_smoothing=eps).sum()
    )(jnp.asarray(h))
    assert abs(float(grad[1])) < 1e-6
    if eps == 0.5:  # symmetric in h, minimised at h = 0 with value log 2
        assert_close(loss[1], np.log(2))
        assert_close(loss[0], loss[2], rtol=1e-6)


@given(pairs, betas, st.floats(0.0, 0.45))
def test_robust_dpo_is_unbiased_under_label_flips(pair, beta, eps):
    # Labels flipped with probability eps: the expected rDPO loss is the clean DPO loss.
    expected = (1 - eps) * np.asarray(
        robust_dpo_loss(*pair, beta=beta, label_smoothing=eps), np.float64
    )
    expected += eps * np.asarray(
        robust_dpo_loss(*swapped(pair), beta=beta, label_smoothing=eps), np.float64
    )
    assert_close(expected, dpo_loss(*pair, beta=beta), rtol=1e-4, atol=1e-4)
    # It is DPO minus a linear term in the margin, and DPO itself at eps = 0.
    linear = eps / (1 - 2 * eps) * beta * ref.margin(*pair)
    assert_close(
        robust_dpo_loss(*pair, beta=beta, label_smoothing=eps),
        ref.dpo(*pair, beta) - linear,
        rtol=1e-4,
        atol=1e-4,
    )
    assert_close(robust_dpo_loss(*pair, beta=beta, label_smoothing=0.0), dpo_loss(*pair, beta=beta))


@given(pairs, st.tuples(*[float_arrays((B,), 1, 50)] * 2), st.floats(0.5, 10.0))
def test_length_normalized_dpo_is_dpo_on_means(pair, lengths, beta):
    lengths = [np.round(x).astype(np.int32) for x in lengths]
    chosen, rejected, ref_chosen, ref_rejected = pair
    len_c, len_r = (x.astype(np.float32) for x in lengths)
    means = (chosen / len_c, rejected / len_r, ref_chosen / len_c, ref_rejected / len_r)
    out = length_normalized_dpo_loss(*pair, *lengths, beta=beta)
    assert_close(out, dpo_loss(*means, beta=beta), rtol=1e-5, atol=1e-5)
    # Integer and float counts agree; repeating every completion k times changes nothing.
    assert_close(
        length_normalized_dpo_loss(*pair, len_c, len_r, beta=beta), out, rtol=1e-6, atol=1e-7
    )
    doubled = length_normalized_dpo_loss(*(2 * x for x in pair), 2 * len_c, 2 * len_r, beta=beta)
    assert_close(doubled, out, rtol=1e-5, atol=1e-6)


def test_length_normalized_dpo_with_unit_lengths_is_dpo():
    pair = tuple(
        np.asarray(x, np.float32) for x in ([-1.0, -2.0], [-3.0, -0.5], [-1.5, -2.0], [-2.0, -1.0])
    )
    ones = np.ones(2, np.int32)
    assert_close(length_normalized_dpo_loss(*pair, ones, ones, beta=0.7), dpo_loss(*pair, beta=0.7))
    # An empty completion (length 0, sum 0) counts as length 1: finite, as sequence_mean.
    zero = np.zeros(2, np.int32)
    empty = (np.zeros(2, np.float32), pair[1], np.zeros(2, np.float32), pair[3])
    out = length_normalized_dpo_loss(*empty, zero, ones, beta=0.7)
    assert np.all(np.isfinite(out))
    assert_close(out, length_normalized_dpo_loss(*empty, ones, ones, beta=0.7))


def test_hyperparameter_and_length_errors():
    pair = [jnp.zeros(3)] * 4
    lengths = jnp.ones(3, jnp.int32)
    with own_checks():
        for fn in (losses.dpo_loss, losses.robust_dpo_loss):
            with raises_naming("beta", error=ValueError):
                fn(*pair, beta=0.0)
        with raises_naming("label_smoothing", error=ValueError):
            losses.dpo_loss(*pair, label_smoothing=1.5)
        with raises_naming("label_smoothing", "[0, 0.5)", error=ValueError):
            losses.robust_dpo_loss(*pair, label_smoothing=0.5)
        with raises_naming("beta", error=ValueError):
            losses.length_normalized_dpo_loss(*pair, lengths, lengths, beta=-1.0)
        with raises_naming("chosen_lengths", error=TypeError):
            losses.length_normalized_dpo_loss(*pair, jnp.ones(3, bool), lengths)
        with raises_naming("rejected_lengths", "(2,)", "(3,)", error=ValueError):
            losses.length_normalized_dpo_loss(*pair, lengths, lengths[:2])
    with raises_naming("chosen_lengths"):
        losses.length_normalized_dpo_loss(*pair, jnp.ones(3, bool), lengths)


def test_docs_page_examples_run():
    """Every python block of docs/losses/preference.md runs, in order, and trains."""
    page = pathlib.Path(__file__).parents[2] / "docs" / "losses" / "preference.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)
    assert blocks
    namespace: dict = {}
    exec(compile("\n".join(blocks), str(page), "exec"), namespace)
    history = namespace["history"]
    assert history[-1] < history[0]


# ---------------------------------------------------------------------------------------------
# Losses that replace the logistic link by another function of the margin.


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
def test_exo_is_a_kl_divergence(pair, beta, eps):
    loss = np.asarray(exo_loss(*pair, beta=beta, label_smoothing=eps))
    assert np.all(loss >= -1e-6)
    # KL = cross-entropy against the labels (1 - eps, eps) minus the model's own entropy.
    x = beta * ref.margin(*pair)
    p = ref.sigmoid(x)
    cross_entropy = -p * np.log1p(-eps) - (1 - p) * np.log(eps)
    entropy = -p * ref.log_sigmoid(x) - (1 - p) * ref.log_sigmoid(-x)
    assert_close(loss, cross_entropy - entropy, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("eps", [1e-3, 0.1, 0.4])
def test_exo_vanishes_where_the_model_matches_the_labels(eps):
    beta = 0.5
    best = np.log((1 - eps) / eps) / beta
    value, derivative = of_margin(losses.exo_loss, beta=beta, label_smoothing=eps)
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


def test_margin_hyperparameter_errors():
    pair = [jnp.zeros(3)] * 4
    with own_checks():
        for fn in (losses.ipo_loss, losses.hinge_loss, losses.exo_loss, losses.discopop_loss):
            with raises_naming("beta", error=ValueError):
                fn(*pair, beta=0.0)
        for eps in (0.0, 1.0):
            with raises_naming("label_smoothing", "(0, 1)", error=ValueError):
                losses.exo_loss(*pair, label_smoothing=eps)
        with raises_naming("tau", error=ValueError):
            losses.discopop_loss(*pair, tau=-0.1)


# ---------------------------------------------------------------------------------------------
# Losses with a term on each completion's log-ratio.

log_ratios = st.tuples(*[float_arrays((B,), -40.0, 40.0)] * 2)


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


# ---------------------------------------------------------------------------------------------
# AOT: a loss on the batch's sorted log-ratios.

aot_loss = jax.jit(losses.aot_loss, static_argnames="paired")

AOT_B = 6
aot_pairs = st.tuples(*[float_arrays((AOT_B,), -30.0, 0.0)] * 4)
modes = pytest.mark.parametrize("paired", [False, True])


def valid_mean(loss, where):
    return float(np.sum(loss)) / max(int(np.sum(where)), 1)


@modes
@given(aot_pairs, st.permutations(range(AOT_B)), st.floats(0.05, 2.0), st.floats(0.0, 0.5))
def test_invariant_to_the_order_of_the_batch(paired, pair, order, beta, eps):
    order = np.array(order)
    loss = aot_loss(*pair, beta=beta, label_smoothing=eps, paired=paired)
    permuted = aot_loss(*(x[order] for x in pair), beta=beta, label_smoothing=eps, paired=paired)
    np.testing.assert_array_equal(permuted, loss)
    assert_close(
        loss, ref.aot(*pair, beta=beta, label_smoothing=eps, paired=paired), rtol=1e-4, atol=1e-4
    )


@modes
@given(aot_pairs, st.floats(0.05, 2.0), st.floats(0.0, 0.5))
def test_one_pair_is_dpo(paired, pair, beta, eps):
    one = [x[:1] for x in pair]
    assert_close(
        aot_loss(*one, beta=beta, label_smoothing=eps, paired=paired),
        losses.dpo_loss(*one, beta=beta, label_smoothing=eps),
        rtol=1e-5,
        atol=1e-5,
    )


def test_quantiles_are_matched_not_pairs():
    # Unpaired: r_w = (3, -1), r_l = (0, 2); sorted (-1, 3) against (0, 2): deltas (-1, 1).
    r_w, r_l = np.array([3.0, -1.0], np.float32), np.array([0.0, 2.0], np.float32)
    zeros = np.zeros(2, np.float32)
    loss = aot_loss(r_w, r_l, zeros, zeros, beta=1.0)
    assert_close(loss, -ref.log_sigmoid(np.array([-1.0, 1.0])))
    # Paired: policy margins (3, -1) against reference margins (1, -1): sorted deltas (0, 2).
    chosen, rejected = np.array([3.0, -1.0], np.float32), zeros
    ref_chosen, ref_rejected = np.array([1.0, 0.0], np.float32), np.array([0.0, 1.0], np.float32)
    loss = aot_loss(chosen, rejected, ref_chosen, ref_rejected, beta=1.0, paired=True)
    assert_close(loss, -ref.log_sigmoid(np.array([0.0, 2.0])))


@modes
def test_masked_rows_take_no_part_in_the_sort(paired):
    rng = np.random.default_rng(0)
    pair = [rng.uniform(-20, 0, 6).astype(np.float32) for _ in range(4)]
    where = np.array([True, False, True, True, False, True])
    sliced = aot_loss(*(x[where] for x in pair), beta=0.5, paired=paired)
    for bad in (np.nan, -np.inf, np.inf, -1e30, 1e30):
        garbage = [np.where(where, x, np.float32(bad)) for x in pair]
        loss = aot_loss(*garbage, beta=0.5, paired=paired, where=where)
        # Valid ranks first, equal to the batch without the masked rows; masked ranks 0.
        assert_close(loss[:4], sliced, rtol=1e-6, atol=1e-7)
        assert np.all(np.asarray(loss[4:]) == 0)
        assert_close(valid_mean(loss, where), np.mean(sliced), rtol=1e-6)


@modes
def test_gradient_reaches_each_valid_row_once(paired):
    rng = np.random.default_rng(1)
    pair = [jnp.asarray(rng.uniform(-20, 0, 5), jnp.float32) for _ in range(4)]
    where = jnp.array([True, True, False, True, True])
    pair[0] = pair[0].at[2].set(jnp.nan)

    def mean_loss(chosen):
        loss = losses.aot_loss(chosen, *pair[1:], beta=0.5, paired=paired, where=where)
        return jnp.sum(loss) / jnp.sum(where)

    grad = np.asarray(jax.grad(mean_loss)(pair[0]))
    assert np.all(np.isfinite(grad)) and grad[2] == 0
    # Each chosen row sits at exactly one rank, so its gradient is that rank's d loss / d delta.
    assert np.all(grad[np.asarray(where)] < 0)


def test_unpaired_identical_distributions_give_log_2():
    # Chosen and rejected log-ratios with the same values in a different order.
    r = np.array([-3.0, 0.5, 2.0, -1.0], np.float32)
    zeros = np.zeros(4, np.float32)
    assert_close(aot_loss(r, r[::-1], zeros, zeros, beta=0.7), np.full(4, np.log(2)))


def test_aot_hyperparameter_errors():
    pair = [jnp.zeros(3)] * 4
    with own_checks():
        with raises_naming("beta", error=ValueError):
            losses.aot_loss(*pair, beta=0.0)
        with raises_naming("label_smoothing", error=ValueError):
            losses.aot_loss(*pair, label_smoothing=-0.1)
