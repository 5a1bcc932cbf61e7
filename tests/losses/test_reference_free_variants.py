"""AlphaPO's reward shape in SimPO and CPO, label-smoothed ORPO, and TRL's CPO NLL
(tunelib/losses/_reference_free.py), each against a float64 transcription of TRL or Tunix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_close, bool_arrays, float_arrays, own_checks, raises_naming
from tests.losses import _preference_refs as ref
from tunelib import logprobs, losses

simpo_loss = jax.jit(losses.simpo_loss)
cpo_loss = jax.jit(losses.cpo_loss)
orpo_loss = jax.jit(losses.orpo_loss)

B = 4
means = st.tuples(*[float_arrays((B,), -5.0, -(2.0**-7))] * 2)


def trl_alphapo_rewards(logps, alpha):
    """TRL 1.16 `CPOTrainer.cpo_loss`: r = (1 - p^(-alpha)) / alpha with p = exp(logps)."""
    p = np.exp(np.asarray(logps, np.float64))
    return (1 - p ** (-alpha)) / alpha


@given(means, st.floats(0.05, 1.0), st.floats(0.5, 10.0), st.floats(0.0, 3.0))
def test_alphapo_simpo_matches_trl(pair, alpha, beta, gamma):
    chosen, rejected = pair
    out = simpo_loss(chosen, rejected, beta=beta, margin=gamma, reward_shape=alpha)
    # TRL: logits = r_w - r_l - simpo_gamma / beta, loss = -log sigmoid(beta * logits).
    logits = (
        trl_alphapo_rewards(chosen, alpha) - trl_alphapo_rewards(rejected, alpha) - gamma / beta
    )
    assert_close(out, -ref.log_sigmoid(beta * logits), rtol=1e-4, atol=1e-5)


# TRL's (1 - p^-alpha) / alpha loses its digits for tiny alpha: 0 (TRL's log-probs) or >= 0.01.
TRL_ALPHAS = st.one_of(st.just(0.0), st.floats(0.01, 0.1), st.floats(-0.1, -0.01))


@given(st.tuples(*[float_arrays((B,), -20.0, 0.0)] * 2), TRL_ALPHAS, st.floats(0.05, 2.0))
def test_alphapo_cpo_matches_trl(pair, alpha, beta):
    chosen, rejected = pair
    out = cpo_loss(chosen, rejected, beta=beta, nll_weight=0.0, reward_shape=alpha)
    if alpha == 0:
        logits = chosen.astype(np.float64) - rejected
    else:
        logits = trl_alphapo_rewards(chosen, alpha) - trl_alphapo_rewards(rejected, alpha)
    assert_close(out, -ref.log_sigmoid(beta * logits), rtol=1e-4, atol=1e-5)


@given(means, st.floats(0.5, 10.0), st.floats(0.0, 3.0), st.floats(0.0, 0.5))
def test_reward_shape_zero_is_simpo_and_continuous(pair, beta, gamma, eps):
    chosen, rejected = pair
    hyper = {"beta": beta, "margin": gamma, "label_smoothing": eps}
    simpo = np.asarray(simpo_loss(chosen, rejected, **hyper))
    assert_close(simpo, ref.simpo(chosen, rejected, **hyper), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(simpo_loss(chosen, rejected, reward_shape=0.0, **hyper), simpo)
    near = simpo_loss(chosen, rejected, reward_shape=1e-6, **hyper)
    assert_close(near, simpo, rtol=1e-4, atol=1e-4)


def test_reward_slope_is_a_power_of_the_probability():
    # dR/dl = e^(-alpha l): the gradient of each log-prob is the SimPO gradient times p^-alpha.
    chosen, rejected = jnp.array([-0.5, -2.0]), jnp.array([-1.0, -3.0])
    for alpha in (0.5, -0.5):

        def total(c, r, alpha=alpha):
            return losses.simpo_loss(c, r, margin=0.0, reward_shape=alpha).sum()

        d_c, d_r = jax.grad(total, argnums=(0, 1))(chosen, rejected)
        x = 2.0 * (ref.alpha_reward(chosen, alpha) - ref.alpha_reward(rejected, alpha))
        d_logit = -2.0 * ref.sigmoid(-x)  # d/dx of -log sigmoid(x), times beta = 2
        assert_close(d_c, d_logit * np.exp(-alpha * np.asarray(chosen)), rtol=1e-5)
        assert_close(d_r, -d_logit * np.exp(-alpha * np.asarray(rejected)), rtol=1e-5)


def test_reward_exponent_is_capped():
    # alpha l = -1e4 would overflow float32 (and float64); the exponent stops at 80.
    chosen, rejected = jnp.array([-1e4, -1.0]), jnp.array([-1.0, -1e4])
    value, grads = jax.value_and_grad(
        lambda c, r: losses.cpo_loss(c, r, reward_shape=1.0, nll_weight=0.0).sum(), argnums=(0, 1)
    )(chosen, rejected)
    assert np.isfinite(value) and all(np.all(np.isfinite(g)) for g in grads)
    cap = -np.expm1(80.0)
    assert_close(value, -ref.log_sigmoid(0.1 * (cap - (1 - np.e))) + 0.0, rtol=1e-5, atol=1e-5)
    assert float(grads[0][0]) == 0 and float(grads[1][1]) == 0


# ---------------------------------------------------------------------------------------------
# Label-smoothed ORPO.

orpo_inputs = st.tuples(*[float_arrays((B,), -8.0, -(2.0**-20))] * 2)


@given(orpo_inputs, st.floats(0.0, 1.0), st.floats(0.0, 0.5))
def test_orpo_label_smoothing_is_a_flipped_label_cross_entropy(pair, lambda_, eps):
    chosen, rejected = pair
    smoothed = orpo_loss(chosen, rejected, odds_ratio_weight=lambda_, label_smoothing=eps)
    clean = np.asarray(orpo_loss(chosen, rejected, odds_ratio_weight=lambda_), np.float64)
    flipped = np.asarray(
        orpo_loss(rejected, chosen, odds_ratio_weight=lambda_, chosen_nll=-chosen), np.float64
    )
    # (1 - eps) * the clean term + eps * the term with the pair swapped (same NLL).
    assert_close(smoothed, (1 - eps) * clean + eps * flipped, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
        orpo_loss(chosen, rejected, label_smoothing=0.0), orpo_loss(chosen, rejected)
    )


@pytest.mark.parametrize("eps", [0.05, 0.2, 0.5])
def test_orpo_smoothed_minimum_is_at_a_finite_odds_ratio(eps):
    # In the log odds ratio o, the smoothed term is minimal at o = log((1 - eps) / eps).
    best = np.log((1 - eps) / eps)
    rejected = jnp.full(3, -1.0)
    target = ref.log_odds(-1.0) + np.array([best - 0.5, best, best + 0.5])
    # Invert log odds: l = -log(1 + e^-o) = log sigmoid(o).
    chosen = jnp.asarray(ref.log_sigmoid(target), jnp.float32)
    nll = jnp.zeros(3)
    term = np.asarray(orpo_loss(chosen, rejected, label_smoothing=eps, chosen_nll=nll))
    assert term[1] < term[0] and term[1] < term[2]


def tunix_orpo(chosen_tokens, rejected_tokens, chosen_mask, rejected_mask, lambda_orpo, eps):
    """Tunix 0.1.7 `dpo_loss_fn(algorithm="orpo")` in float64: odds of the summed log-probs,
    the NLL as the sum over the length, the mean over pairs."""
    chosen_tokens, rejected_tokens = (
        np.asarray(chosen_tokens, np.float64),
        np.asarray(rejected_tokens, np.float64),
    )
    chosen_logps = (chosen_tokens * chosen_mask).sum(-1)
    rejected_logps = (rejected_tokens * rejected_mask).sum(-1)
    sft = -chosen_logps / np.maximum(chosen_mask.sum(-1), 1)
    log_odds = (chosen_logps - rejected_logps) - (
        np.log1p(-np.exp(chosen_logps)) - np.log1p(-np.exp(rejected_logps))
    )
    odds_ratio = -(ref.log_sigmoid(log_odds) * (1 - eps) + ref.log_sigmoid(-log_odds) * eps)
    return np.mean(sft + lambda_orpo * odds_ratio)


@given(
    float_arrays((3, 4), -2.0, -(2.0**-7)),
    float_arrays((3, 4), -2.0, -(2.0**-7)),
    bool_arrays((3, 4)),
    bool_arrays((3, 4)),
    st.floats(0.0, 0.5),
)
def test_orpo_matches_tunix(chosen_tokens, rejected_tokens, mask_c, mask_r, eps):
    mask_c[:, 0] = mask_r[:, 0] = True  # a completion has a token at least
    chosen = logprobs.sequence_sum(chosen_tokens, where=mask_c)
    rejected = logprobs.sequence_sum(rejected_tokens, where=mask_r)
    nll = -logprobs.sequence_mean(chosen_tokens, where=mask_c)
    out = orpo_loss(chosen, rejected, odds_ratio_weight=0.2, label_smoothing=eps, chosen_nll=nll)
    expected = tunix_orpo(chosen_tokens, rejected_tokens, mask_c, mask_r, 0.2, eps)
    assert_close(jnp.mean(out), expected, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# TRL's CPO NLL: one token mean over the batch's chosen completions.


@given(
    float_arrays((4, 6), -4.0, 0.0),
    float_arrays((4, 5), -4.0, 0.0),
    bool_arrays((4, 6)),
    bool_arrays((4, 5)),
    st.floats(0.05, 1.0),
    st.floats(0.0, 2.0),
)
def test_cpo_matches_trl_with_a_token_mean_nll(c_tokens, r_tokens, mask_c, mask_r, beta, cpo_alpha):
    mask_c[:, 0] = True  # TRL's cross-entropy needs one valid chosen token in the batch
    chosen = logprobs.sequence_sum(c_tokens, where=mask_c)
    rejected = logprobs.sequence_sum(r_tokens, where=mask_r)
    # The call the cpo_loss docstring gives.
    preference = losses.cpo_loss(chosen, rejected, beta=beta, nll_weight=0.0)
    nll = losses.aggregate(-jnp.asarray(c_tokens), mode="token_mean", where=mask_c)
    loss = jnp.mean(preference) + cpo_alpha * nll.mean()
    expected = ref.trl_cpo_batch_loss(c_tokens, r_tokens, mask_c, mask_r, beta, cpo_alpha)
    assert_close(loss, expected, rtol=1e-5, atol=1e-5)


def test_per_pair_token_mean_nll_is_not_trls():
    # Completions of 1 and 3 tokens: the token mean weighs the long one three times as much.
    c_tokens = np.array([[-3.0, 0.0, 0.0], [-1.0, -1.0, -1.0]], np.float32)
    mask_c = np.array([[True, False, False], [True, True, True]])
    r_tokens, mask_r = np.full((2, 1), -2.0, np.float32), np.ones((2, 1), bool)
    chosen = logprobs.sequence_sum(c_tokens, where=mask_c)
    rejected = logprobs.sequence_sum(r_tokens, where=mask_r)
    per_pair = losses.cpo_loss(
        chosen, rejected, chosen_nll=-logprobs.sequence_mean(c_tokens, where=mask_c)
    )
    trl = ref.trl_cpo_batch_loss(c_tokens, r_tokens, mask_c, mask_r, beta=0.1, cpo_alpha=1.0)
    # Token mean NLL (3 + 3) / 4 = 1.5; mean of per-pair means (3 + 1) / 2 = 2.
    assert_close(float(jnp.mean(per_pair)) - trl, 0.5, rtol=1e-5)


def test_new_hyperparameter_errors():
    pair = [jnp.zeros(3)] * 2
    with own_checks():
        for fn in (losses.simpo_loss, losses.cpo_loss):
            with raises_naming("reward_shape", error=ValueError):
                fn(*pair, reward_shape=float("inf"))
        with raises_naming("label_smoothing", error=ValueError):
            losses.orpo_loss(*pair, label_smoothing=1.5)
