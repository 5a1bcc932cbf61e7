import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_close, float_arrays, own_checks, raises_naming
from tests.losses import _rl_refs as ref
from tunelib import losses

LOGP = (-8.0, 0.0)
NEAR = ("near", 0, -1.0, 1.0)
ADV = (-3.0, 3.0)
PG = ("token_logps", "old_token_logps", "advantages")
KERNEL = {k: (0.5, 4.0) for k in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")}


def vespo_with_weights(logps, old, adv, weights, **kw):
    return losses.vespo_loss(logps, old, adv, importance_weights=weights, **kw)


SPECS = [
    ref.Spec(losses.vespo_loss, ref.vespo, PG, (LOGP, NEAR, ADV), KERNEL, id="vespo_loss"),
    ref.Spec(
        vespo_with_weights,
        ref.vespo,
        (*PG, "importance_weights"),
        (LOGP, NEAR, ADV, (0.0, 2.0)),
        {"log_ratio_clamp": (0.5, 20.0)},
        id="vespo_loss_importance_weights",
    ),
    ref.Spec(
        losses.luspo_loss,
        ref.ppo,
        PG,
        (LOGP, NEAR, ADV),
        {"epsilon_low": (0.0, 0.5), "epsilon_high": (0.0, 0.5)},
        static={"level": "sequence"},
        id="luspo_loss",
    ),
]


@pytest.fixture(scope="module", params=SPECS, ids=[s.id for s in SPECS])
def spec(request):
    return request.param


class TestContracts(ref.TokenContracts):
    pass


@pytest.mark.parametrize("spec", SPECS, ids=[s.id for s in SPECS])
def test_advantages_must_be_per_sequence_or_per_token(spec):
    ref.check_advantage_shapes(spec)


def grad_logps(fn, logps, *args, **kwargs):
    return np.asarray(jax.grad(lambda x: jnp.sum(fn(x, *args, **kwargs)))(jnp.asarray(logps)))


def rows_with_sequence_log_ratios(log_w, t=4):
    """Log-probs whose row i has the sequence log-ratio log_w[i], spread over t tokens."""
    logps = np.tile(np.log([0.5, 0.3, 0.6, 0.2][:t]), (len(log_w), 1)).astype(np.float32)
    old = (logps - np.asarray(log_w)[:, None] / t).astype(np.float32)
    return logps, old


# --- VESPO.


def test_vespo_on_policy_is_reinforce():
    rng = np.random.default_rng(0)
    logps = rng.uniform(-3, 0, (3, 5)).astype(np.float32)
    adv = np.array([1.5, -0.5, 2.0], np.float32)
    where = np.arange(5)[None, :] < np.array([[5], [2], [3]])
    out = losses.vespo_loss(logps, logps, adv, where=where)
    assert_close(out, np.where(where, -adv[:, None] * logps, 0.0), rtol=1e-6)
    grad = grad_logps(losses.vespo_loss, logps, logps, adv, where=where)
    assert_close(grad, np.where(where, -adv[:, None], 0.0), rtol=1e-6)


@pytest.mark.parametrize(("k", "lam"), [(2.0, 3.0), (3.0, 2.0), (1.0, 0.5)])
def test_vespo_weight_is_the_normalised_gamma_kernel(k, lam):
    """phi(w) = w^k e^(lambda (1 - w)): 1 at w = 1, largest at w = k / lambda, vanishing at
    both ends; the gradient of each token is -phi(w) A."""
    w = np.array([1e-3, 0.5, 1.0, k / lam, 1.5 * k / lam, 30.0])
    logps, old = rows_with_sequence_log_ratios(np.log(w))
    adv = np.ones(len(w), np.float32)
    kw = {"k_pos": k, "lambda_pos": lam}
    grad = grad_logps(losses.vespo_loss, logps, old, adv, **kw)
    phi = -grad[:, 0]
    assert_close(grad, np.broadcast_to(-phi[:, None], grad.shape), rtol=0, atol=0)
    assert_close(phi, w**k * np.exp(lam * (1 - w)), rtol=2e-5, atol=1e-12)
    assert_close(phi[2], 1.0, rtol=1e-6)
    assert np.argmax(phi) == 3 and phi[0] < 1e-2 and phi[-1] < 1e-4


def test_vespo_advantage_sign_picks_the_kernel():
    logps, old = rows_with_sequence_log_ratios(np.log([2.0, 2.0, 2.0]))
    adv = np.array([1.0, 0.0, -1.0], np.float32)
    kw = {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}
    out = np.asarray(losses.vespo_loss(logps, old, adv, **kw))
    phi_pos, phi_neg = 4 * np.exp(-3.0), 8 * np.exp(-2.0)  # phi(2) of each kernel
    assert_close(out[0], -phi_pos * logps[0], rtol=1e-5)
    assert np.all(out[1] == 0)
    assert_close(out[2], phi_neg * logps[2], rtol=1e-5)
    # Per-token advantages pick the kernel token by token.
    mixed = np.array([[1.0, -1.0, 1.0, -1.0]], np.float32)
    grad = grad_logps(losses.vespo_loss, logps[:1], old[:1], mixed, **kw)
    assert_close(grad, [[-phi_pos, phi_neg, -phi_pos, phi_neg]], rtol=1e-5)


def test_vespo_weight_is_the_product_not_the_geometric_mean():
    """The same per-token ratio on twice as many tokens squares w (GSPO's ratio would not
    change)."""
    r = 1.2
    short, short_old = rows_with_sequence_log_ratios(np.log([r**2]), t=2)
    long, long_old = rows_with_sequence_log_ratios(np.log([r**4]), t=4)
    adv = np.ones(1, np.float32)
    phi_short = -grad_logps(losses.vespo_loss, short, short_old, adv)[0, 0]
    phi_long = -grad_logps(losses.vespo_loss, long, long_old, adv)[0, 0]
    kernel = lambda w: w**2 * np.exp(3 * (1 - w))  # noqa: E731
    assert_close([phi_short, phi_long], [kernel(r**2), kernel(r**4)], rtol=1e-5)


def test_vespo_importance_weights_multiply_the_sequence_ratio():
    rng = np.random.default_rng(1)
    logps = rng.uniform(-2, 0, (3, 4)).astype(np.float32)
    old = (logps + rng.uniform(-0.2, 0.2, (3, 4))).astype(np.float32)
    rho = rng.uniform(0.5, 1.5, (3, 4)).astype(np.float32)
    adv = np.array([1.0, -1.0, 0.5], np.float32)
    where = np.array([[True] * 4, [True, True, False, False], [True, False, True, True]])
    with_rho = losses.vespo_loss(logps, old, adv, importance_weights=rho, where=where)
    # rho = pi_old / pi_sampler: the weight is then pi_theta / pi_sampler.
    sampler = (old - np.log(rho)).astype(np.float32)
    shifted = losses.vespo_loss(logps, sampler, adv, where=where)
    assert_close(with_rho, shifted, rtol=1e-5, atol=1e-6)
    # A masked-out (MIS) weight of 0 counts as 1e-8: the sequence loses its weight.
    rho[0, 1] = 0.0
    dropped = np.asarray(losses.vespo_loss(logps, old, adv, importance_weights=rho))
    assert np.all(np.abs(dropped[0]) < 1e-12)


def test_vespo_log_weight_clamps():
    # log w beyond 20 is clamped to 20 (phi = 0); below log 1e-8 to log 1e-8.
    logps, old = rows_with_sequence_log_ratios([40.0, -60.0])
    adv = np.ones(2, np.float32)
    grad = grad_logps(losses.vespo_loss, logps, old, adv, k_pos=0.5, lambda_pos=0.5)
    expected = [0.0, np.exp(0.5 + 0.5 * np.log(1e-8) - 0.5 * 1e-8)]
    assert_close(-grad[:, 0], expected, rtol=1e-4, atol=0)
    # Each token's log-ratio is clipped to [-c, c] before the sum.
    logps, old = np.zeros((1, 2), np.float32), np.array([[-3.0, 2.0]], np.float32)
    got = -grad_logps(losses.vespo_loss, logps, old, adv[:1], log_ratio_clamp=1.0)[0, 0]
    w = np.exp(1.0 - 1.0)
    assert_close(got, w**2 * np.exp(3 * (1 - w)), rtol=1e-6)


# --- LUSPO.


def test_luspo_reduction_weighs_each_sequence_by_its_length():
    """(1/B) sum_i |y_i| l_i from the mean over sequences of their token sums; TRL's luspo
    reduction, (1/B) sum_i (l_i m_i).sum(), counts an empty row as a sequence of loss 0."""
    rng = np.random.default_rng(2)
    logps = rng.uniform(-3, 0, (4, 6)).astype(np.float32)
    old = (logps + rng.uniform(-0.3, 0.3, (4, 6))).astype(np.float32)
    adv = np.array([1.0, -0.5, 2.0, -1.5], np.float32)
    where = np.arange(6)[None, :] < np.array([[6], [3], [1], [5]])
    eps = {"epsilon_low": 0.05, "epsilon_high": 0.08}
    per_token = losses.luspo_loss(logps, old, adv, **eps, where=where)
    value = losses.aggregate(per_token, mode="seq_mean_token_sum", where=where).mean()
    n = where.sum(-1)
    per_sequence = [
        ref.ppo(*row, level="sequence", **eps)[0] for row in ref.rows(where, logps, old, adv)
    ]
    assert_close(value, np.mean(n * np.array(per_sequence)), rtol=1e-6)
    # An empty fifth row: TRL's mean over all rows is empty_rows="count".
    padded = [np.concatenate([x, np.zeros((1, 6), np.float32)]) for x in (logps, old)]
    where5 = np.concatenate([where, np.zeros((1, 6), bool)])
    adv5 = np.append(adv, 1.0).astype(np.float32)
    per_token5 = losses.luspo_loss(*padded, adv5, **eps, where=where5)
    trl = np.mean(np.where(where5, np.asarray(per_token5, np.float64), 0).sum(-1))
    counted = losses.aggregate(
        per_token5, mode="seq_mean_token_sum", empty_rows="count", where=where5
    )
    assert_close(counted.mean(), trl, rtol=1e-6)
    assert_close(counted.mean(), 4 / 5 * np.mean(n * np.array(per_sequence)), rtol=1e-6)
    # The per-token values are GSPO's.
    gspo = losses.policy_gradient_loss(logps, old, adv, level="sequence", **eps, where=where)
    assert_close(per_token, gspo, rtol=0, atol=0)


def test_luspo_token_gradients_do_not_depend_on_the_length():
    """Two sequences with the same ratio and advantage, lengths 2 and 6: under GSPO's
    per-sequence mean a token of the short one gets 3x the gradient; under LUSPO the same."""
    logps = np.log(np.full((2, 6), 0.4)).astype(np.float32)
    old = (logps - 0.01).astype(np.float32)  # s = e^0.01, inside the clip range below
    where = np.arange(6)[None, :] < np.array([[2], [6]])
    adv = np.array([1.0, 1.0], np.float32)
    wide = {"epsilon_low": 0.2, "epsilon_high": 0.2, "where": where}

    def objective(x, mode, **kw):
        per_token = losses.luspo_loss(x, old, adv, **wide)
        return losses.aggregate(per_token, mode=mode, where=where, **kw).mean()

    luspo = np.asarray(jax.grad(objective)(jnp.asarray(logps), "seq_mean_token_sum"))
    gspo = np.asarray(jax.grad(objective)(jnp.asarray(logps), "seq_mean_token_mean"))
    s = np.exp(0.01)
    assert_close(luspo[where], np.full(8, -s / 2), rtol=1e-5)
    assert_close(gspo[0, :2], 3 * gspo[1, :2], rtol=1e-5)


# --- Argument checks.


def test_hyperparameter_errors():
    logps = np.zeros((2, 3), np.float32)
    adv = np.ones(2, np.float32)
    with raises_naming("level", "sequence"):
        losses.luspo_loss(logps, logps, adv, level="geometric")
    with own_checks():
        for name in ("k_pos", "k_neg"):
            with raises_naming(name, error=ValueError):
                losses.vespo_loss(logps, logps, adv, **{name: -1.0})
        for name in ("lambda_pos", "lambda_neg", "log_ratio_clamp"):
            with raises_naming(name, error=ValueError):
                losses.vespo_loss(logps, logps, adv, **{name: 0.0})
        with raises_naming("importance_weights", "(2, 2)", "(2, 3)", error=ValueError):
            losses.vespo_loss(logps, logps, adv, importance_weights=np.ones((2, 2), np.float32))
        with raises_naming("epsilon_low", error=ValueError):
            losses.luspo_loss(logps, logps, adv, epsilon_low=-0.1)


@given(float_arrays((2, 3), -4.0, 0.0), st.floats(0.5, 4.0), st.floats(0.5, 4.0))
def test_vespo_gradient_is_bounded_by_the_kernel_peak(logps, k, lam):
    old = (logps - 0.3).astype(np.float32)
    adv = np.array([1.0, -2.0], np.float32)
    grad = np.asarray(vespo_grad(logps, old, adv, k, lam))
    peak = (k / lam) ** k * np.exp(lam - k)  # phi at w = k / lambda
    assert np.all(np.abs(grad) <= peak * np.abs(adv)[:, None] * (1 + 1e-5))


@jax.jit
def vespo_grad(logps, old, adv, k, lam):
    kw = {"k_pos": k, "lambda_pos": lam, "k_neg": k, "lambda_neg": lam}
    return jax.grad(lambda x: jnp.sum(losses.vespo_loss(x, old, adv, **kw)))(logps)
