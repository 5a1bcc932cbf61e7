import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_close, float_arrays, own_checks, raises_naming
from tests.losses import _preference_refs as ref
from tunelib import losses
from tunelib.losses._reference_free import _log1mexp

simpo_loss = jax.jit(losses.simpo_loss)
cpo_loss = jax.jit(losses.cpo_loss)
dpo_loss = jax.jit(losses.dpo_loss)
orpo_loss = jax.jit(losses.orpo_loss)
orpo_log_odds_ratio = jax.jit(losses.orpo_log_odds_ratio)

B = 4
means = st.tuples(*[float_arrays((B,), -5.0, 0.0)] * 2)
sums = st.tuples(*[float_arrays((B,), -30.0, 0.0)] * 2)
orpo_inputs = st.tuples(*[float_arrays((B,), -8.0, -(2.0**-20))] * 2)
ZEROS = np.zeros(B, np.float32)


@given(means, st.floats(-3.0, 3.0), st.floats(0.5, 10.0), st.floats(0.0, 5.0), st.floats(0.0, 0.5))
def test_simpo_depends_only_on_the_difference(pair, shift, beta, gamma, eps):
    chosen, rejected = pair
    loss = simpo_loss(chosen, rejected, beta=beta, margin=gamma, label_smoothing=eps)
    shifted = simpo_loss(
        chosen + np.float32(shift),
        rejected + np.float32(shift),
        beta=beta,
        margin=gamma,
        label_smoothing=eps,
    )
    assert_close(shifted, loss, rtol=1e-4, atol=1e-4)
    # With gamma = 0 it is DPO without a reference model.
    no_margin = simpo_loss(chosen, rejected, beta=beta, margin=0.0, label_smoothing=eps)
    assert_close(
        no_margin,
        dpo_loss(chosen, rejected, ZEROS, ZEROS, beta=beta, label_smoothing=eps),
        rtol=1e-5,
        atol=1e-5,
    )


def test_simpo_is_log_2_at_the_target_margin():
    # beta (c - r) = gamma: the logit is 0.
    chosen, rejected = np.array([-0.5, -1.25], np.float32), np.array([-1.0, -1.75], np.float32)
    assert_close(simpo_loss(chosen, rejected, beta=2.0, margin=1.0), np.full(2, np.log(2)))
    assert_close(simpo_loss(chosen, rejected), np.full(2, np.log(2)))  # the defaults: 2.0, 1.0


@given(sums, st.floats(0.05, 2.0), st.floats(0.0, 0.5), st.floats(0.0, 2.0))
def test_cpo_is_reference_free_dpo_plus_nll(pair, beta, eps, alpha):
    chosen, rejected = pair
    loss = np.asarray(
        cpo_loss(chosen, rejected, beta=beta, label_smoothing=eps, nll_weight=alpha), np.float64
    )
    preference = np.asarray(
        dpo_loss(chosen, rejected, ZEROS, ZEROS, beta=beta, label_smoothing=eps), np.float64
    )
    assert_close(loss, preference - alpha * chosen, rtol=1e-5, atol=1e-4)
    # A given NLL (TRL's token mean, say) replaces -chosen_logps.
    nll = np.float32(0.25) * -chosen
    with_nll = cpo_loss(
        chosen, rejected, beta=beta, label_smoothing=eps, nll_weight=alpha, chosen_nll=nll
    )
    assert_close(with_nll, preference + alpha * nll, rtol=1e-5, atol=1e-4)


def test_log1mexp_is_accurate_from_minus_1e_8_to_minus_50():
    x = -np.geomspace(1e-8, 50.0, 400).astype(np.float32)
    # In float64, 1 - e^x keeps a relative error below 1e-7 on this whole range, whichever way
    # it is written; log1p keeps the result accurate where it is tiny (x far below 0).
    exact = np.log1p(-np.exp(x.astype(np.float64)))
    # Both branches, to a few float32 ulps: log(-expm1(x)) near 0, log1p(-exp(x)) below -log 2.
    np.testing.assert_allclose(jax.jit(_log1mexp)(jnp.asarray(x)), exact, rtol=2e-6)
    # And the log odds that ORPO builds on it (odds(1/2) = 1, so the ratio is log odds(x)).
    out = orpo_log_odds_ratio(x, np.full_like(x, -np.log(2)))
    np.testing.assert_allclose(out, ref.log_odds(x), rtol=2e-6, atol=2e-6)


def test_orpo_at_probability_one_is_finite():
    chosen = jnp.array([0.0, -1e-20, -0.5, 0.0])
    rejected = jnp.array([-1.0, -1.0, 0.0, 0.0])

    def total(chosen, rejected):
        return (
            losses.orpo_loss(chosen, rejected).sum()
            + losses.orpo_log_odds_ratio(chosen, rejected).sum()
        )

    value, (d_chosen, d_rejected) = jax.value_and_grad(total, argnums=(0, 1))(chosen, rejected)
    assert np.isfinite(value)
    assert np.all(np.isfinite(d_chosen)) and np.all(np.isfinite(d_rejected))
    # Clamped to -1e-12: log odds = -1e-12 - log(1e-12), about 27.6.
    ratio = orpo_log_odds_ratio(chosen, rejected)
    assert_close(ratio[0], ref.log_odds(-1e-12) - ref.log_odds(-1.0), rtol=1e-5)
    assert_close(ratio[3], 0.0)
    # The NLL term still has its gradient of -1 at an input of 0.
    assert_close(
        jax.grad(lambda c: losses.orpo_loss(c, rejected).sum())(chosen)[0], -1.0, rtol=1e-5
    )


@given(orpo_inputs, st.floats(0.0, 1.0))
def test_orpo_properties(pair, lambda_):
    chosen, rejected = pair
    ratio = np.asarray(orpo_log_odds_ratio(chosen, rejected))
    np.testing.assert_array_equal(np.asarray(orpo_log_odds_ratio(rejected, chosen)), -ratio)
    # Odds are increasing in the probability.
    apart = np.abs(chosen - rejected) > 1e-4
    assert np.all(np.sign(ratio[apart]) == np.sign(chosen - rejected)[apart])
    loss = np.asarray(orpo_loss(chosen, rejected, odds_ratio_weight=lambda_))
    nll = -chosen.astype(np.float64)
    assert np.all(loss >= nll - 1e-5)  # the odds term is a non-negative penalty
    assert_close(
        orpo_loss(chosen, chosen, odds_ratio_weight=lambda_),
        nll + lambda_ * np.log(2),
        rtol=1e-5,
        atol=1e-5,
    )


def test_hyperparameter_errors():
    pair = [jnp.zeros(3)] * 2
    with own_checks():
        for fn in (losses.simpo_loss, losses.cpo_loss):
            with raises_naming("beta", error=ValueError):
                fn(*pair, beta=0.0)
            with raises_naming("label_smoothing", error=ValueError):
                fn(*pair, label_smoothing=2.0)
        with raises_naming("chosen_nll", "(2,)", error=ValueError):
            losses.cpo_loss(*pair, chosen_nll=jnp.zeros(2))
        with raises_naming("chosen_nll", error=TypeError):
            losses.orpo_loss(*pair, chosen_nll=jnp.zeros(3, jnp.int32))
