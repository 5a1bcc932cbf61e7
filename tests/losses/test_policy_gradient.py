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
NEAR = ("near", 0, -1.0, 1.0)  # behaviour log-probs within 1 nat of the current ones
ADV = (-3.0, 3.0)
EPS = {"epsilon_low": (0.0, 0.5), "epsilon_high": (0.0, 0.5)}
PG = ("token_logps", "old_token_logps", "advantages")


def on_policy(data):
    return data[0], None, data[1]


def ratio_spec(level):
    return ref.Spec(
        losses.importance_ratio,
        ref.ratio,
        PG[:2],
        (LOGP, NEAR),
        {"log_ratio_clamp": (0.25, 20.0)},
        static={"level": level},
        id=f"importance_ratio_{level}",
    )


def pg_spec(level, hyper=EPS, **kw):
    return ref.Spec(
        losses.policy_gradient_loss,
        ref.ppo,
        PG,
        (LOGP, NEAR, ADV),
        hyper,
        static={"level": level},
        id=kw.pop("id", f"policy_gradient_loss_{level}"),
        **kw,
    )


SPECS = [
    ratio_spec("token"),
    ratio_spec("sequence"),
    *(pg_spec(level) for level in losses.RATIO_LEVELS),
    pg_spec(
        "token",
        {**EPS, "dual_clip": (1.5, 4.0), "ratio_cap": (0.5, 4.0)},
        id="policy_gradient_loss_dual_clip_ratio_cap",
    ),
    ref.Spec(
        losses.policy_gradient_loss,
        lambda lp, a, **h: ref.ppo(lp, lp, a, **h),
        ("token_logps", "advantages"),
        (LOGP, ADV),
        EPS,
        build=on_policy,
        id="policy_gradient_loss_on_policy",
    ),
    *(
        ref.Spec(
            losses.cispo_loss,
            ref.cispo,
            PG,
            (LOGP, NEAR, ADV),
            {"epsilon_low": (0.0, 2.0), "epsilon_high": (0.0, 4.0)},
            static={"level": level},
            id=f"cispo_loss_{level}",
        )
        for level in ("token", "sequence")
    ),
    ref.Spec(
        losses.cispo_loss,
        ref.cispo,
        PG,
        (LOGP, NEAR, ADV),
        {"epsilon_low": (0.0, 2.0), "ratio_cap": (0.5, 6.0)},
        id="cispo_loss_ratio_cap",
    ),
    *(
        ref.Spec(
            losses.sapo_loss,
            ref.sapo,
            PG,
            (LOGP, NEAR, ADV),
            {"tau_pos": (0.1, 3.0), "tau_neg": (0.1, 3.0)},
            static={"level": level},
            id=f"sapo_loss_{level}",
        )
        for level in ("token", "sequence")
    ),
]


@pytest.fixture(scope="module", params=SPECS, ids=[s.id for s in SPECS])
def spec(request):
    return request.param


class TestContracts(ref.TokenContracts):
    pass


ADV_SPECS = [s for s in SPECS if "advantages" in s.names]


@pytest.mark.parametrize("spec", ADV_SPECS, ids=[s.id for s in ADV_SPECS])
def test_advantages_must_be_per_sequence_or_per_token(spec):
    ref.check_advantage_shapes(spec)


def grad_logps(fn, logps, *args, **kwargs):
    return np.asarray(jax.grad(lambda x: jnp.sum(fn(x, *args, **kwargs)))(jnp.asarray(logps)))


# --- The clipped surrogate: zero gradient outside the trust region on the advantage's side.

RATIOS = np.array([0.5, 0.79, 0.81, 1.0, 1.19, 1.21, 1.27, 1.29, 2.0])


@pytest.mark.parametrize("epsilon_high", [0.2, 0.28])
def test_clipping_gradient_follows_the_advantage_sign(epsilon_high):
    old = np.full((2, RATIOS.size), np.log(0.3), np.float32)
    logps = (old + np.log(RATIOS)).astype(np.float32)
    adv = np.array([1.5, -1.5], np.float32)
    out = losses.policy_gradient_loss(logps, old, adv, epsilon_high=epsilon_high)
    grad = grad_logps(losses.policy_gradient_loss, logps, old, adv, epsilon_high=epsilon_high)
    r = np.exp(logps.astype(np.float64) - old)
    # A > 0: the loss stops rewarding the ratio past 1 + eps_high; below 1 - eps_low it keeps
    # the full gradient. A < 0: the mirror image.
    clipped_pos = r[0] > 1 + epsilon_high
    clipped_neg = r[1] < 0.8
    assert_close(out[0], -1.5 * np.where(clipped_pos, 1 + epsilon_high, r[0]), rtol=1e-6)
    assert_close(out[1], 1.5 * np.where(clipped_neg, 0.8, r[1]), rtol=1e-6)
    assert_close(grad[0], np.where(clipped_pos, 0.0, -1.5 * r[0]), rtol=1e-6)
    assert_close(grad[1], np.where(clipped_neg, 0.0, 1.5 * r[1]), rtol=1e-6)
    assert np.sum(grad == 0) == clipped_pos.sum() + clipped_neg.sum() > 0


def ppo_token_gradient(logps, old, adv, eps_low, eps_high):
    r = np.exp(np.asarray(logps, np.float64) - old)
    outside = ((adv > 0) & (r > 1 + eps_high)) | ((adv < 0) & (r < 1 - eps_low))
    return np.where(outside, 0.0, -adv * r)


@st.composite
def token_problems(draw, shape=(3, 4)):
    """Token-level inputs of one shape (these properties hold per token; the contracts vary
    the shape), so each jitted function compiles once."""
    logps = draw(float_arrays(shape, -8.0, 0.0))
    old = (logps + draw(float_arrays(shape, -1.0, 1.0))).astype(np.float32)
    adv = draw(float_arrays(shape, -3.0, 3.0))
    return logps, old, adv


def jitted_grad(fn):
    return jax.jit(jax.grad(lambda x, *a, **k: jnp.sum(fn(x, *a, **k))))


policy_gradient_loss = jax.jit(losses.policy_gradient_loss)
pg_grad = jitted_grad(losses.policy_gradient_loss)
cispo_grad = jitted_grad(losses.cispo_loss)
sapo_loss = jax.jit(losses.sapo_loss)
sapo_grad = jitted_grad(losses.sapo_loss)


@given(token_problems(), st.floats(0.0, 0.5), st.floats(0.0, 0.5))
def test_clipped_gradient_matches_reference(problem, eps_low, eps_high):
    logps, old, adv = problem
    kw = {"epsilon_low": eps_low, "epsilon_high": eps_high}
    grad = np.asarray(pg_grad(logps, old, adv, **kw))
    expected = ppo_token_gradient(logps, old, adv, eps_low, eps_high)
    # The gradient jumps at the clip bounds; a ratio within rounding of a bound may land on
    # either side in float32 and float64, and both answers are right there.
    r = np.exp(logps.astype(np.float64) - old)
    on_bound = np.isclose(r, 1 - eps_low, rtol=1e-5) | np.isclose(r, 1 + eps_high, rtol=1e-5)
    assert_close(grad[~on_bound], expected[~on_bound], rtol=1e-4)
    loss = np.asarray(policy_gradient_loss(logps, old, adv, **kw), np.float64)
    unclipped = -np.exp(logps.astype(np.float64) - old) * adv
    # The clipped objective is a pessimistic (lower) bound on the unclipped one ...
    assert np.all(loss >= unclipped - 1e-4 * (1 + np.abs(unclipped)))
    # ... and equals it once the clip range contains every ratio.
    wide = policy_gradient_loss(logps, old, adv, epsilon_low=1.0, epsilon_high=1e4)
    assert_close(wide, unclipped, rtol=1e-5, atol=1e-5)


# --- GSPO and GSPO-token.


def gspo_problem(seed=0):
    rng = np.random.default_rng(seed)
    logps = rng.uniform(-4, 0, (4, 6)).astype(np.float32)
    old = (logps + rng.uniform(-0.3, 0.3, (4, 6))).astype(np.float32)
    where = np.arange(6)[None, :] < np.array([[6], [3], [1], [5]])
    adv = np.array([1.0, -0.5, 2.0, -1.5], np.float32)
    return logps, old, adv, where


def test_gspo_token_value_equals_gspo_and_its_gradient_is_per_token():
    logps, old, _, where = gspo_problem()
    lengths = where.sum(-1)
    s = np.exp([(logps[i] - old[i].astype(np.float64))[where[i]].mean() for i in range(4)])
    kw = {"where": where}
    seq = losses.importance_ratio(logps, old, level="sequence", **kw)
    seq_token = losses.importance_ratio(logps, old, level="sequence_token", **kw)
    assert_close(seq, np.where(where, s[:, None], 0.0), rtol=1e-6)
    assert_close(seq_token, seq, rtol=1e-6, atol=0)
    # Weights c_t on the tokens: GSPO-token's gradient is c_t s_i on each token; GSPO's is
    # spread over the row, (sum_t' c_t') s_i / |y_i| on every token.
    c = np.random.default_rng(1).normal(size=(4, 6)).astype(np.float32)

    def weighted(level):
        return grad_logps(
            lambda x: c * losses.importance_ratio(x, old, level=level, where=where), logps
        )

    assert_close(weighted("sequence_token"), np.where(where, c * s[:, None], 0.0), rtol=1e-5)
    row_sums = np.where(where, c, 0).sum(-1)
    expected = np.where(where, (row_sums * s / lengths)[:, None], 0.0)
    assert_close(weighted("sequence"), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("eps", [(3e-4, 4e-4), (0.05, 0.05), (0.5, 0.5)])
def test_gspo_token_gradient_equals_gspo_under_sequence_mean(eps):
    logps, old, adv, where = gspo_problem(seed=2)
    kw = {"epsilon_low": eps[0], "epsilon_high": eps[1], "where": where}

    def objective(level):
        def f(x):
            loss = losses.policy_gradient_loss(x, old, adv, level=level, **kw)
            return losses.aggregate(loss, mode="seq_mean_token_mean", where=where).mean()

        return jax.value_and_grad(f)(jnp.asarray(logps))

    (v_seq, g_seq), (v_tok, g_tok) = objective("sequence"), objective("sequence_token")
    assert_close(v_tok, v_seq, rtol=1e-6)
    assert_close(g_tok, g_seq, rtol=1e-5, atol=1e-7)
    # The paper's GSPO objective: -(1/G) sum_i min(s_i A_i, clip(s_i) A_i).
    s = losses.importance_ratio(logps, old, level="sequence", where=where)[:, 0]
    s = np.asarray(s, np.float64)
    per_seq = -np.minimum(s * adv, np.clip(s, 1 - eps[0], 1 + eps[1]) * adv)
    assert_close(v_seq, per_seq.mean(), rtol=1e-6)


# --- On-policy: REINFORCE with a baseline.


@pytest.mark.parametrize("level", losses.RATIO_LEVELS)
def test_on_policy_value_is_minus_advantage_and_gradient_is_reinforce(level):
    logps, _, _, where = gspo_problem(seed=3)
    adv = np.random.default_rng(4).normal(size=(4, 6)).astype(np.float32)
    kw = {"level": level, "where": where}
    ratio = losses.importance_ratio(logps, None, **kw)
    assert np.all(np.asarray(ratio)[where] == 1) and np.all(np.asarray(ratio)[~where] == 0)
    out = losses.policy_gradient_loss(logps, None, adv, **kw)
    assert np.array_equal(np.asarray(out), np.where(where, -adv, 0.0))
    grad = grad_logps(losses.policy_gradient_loss, logps, None, adv, **kw)
    if level == "sequence":  # the ratio spreads each row's advantage over its tokens
        expected = np.where(where, np.where(where, -adv, 0).sum(-1, keepdims=True), 0.0)
        expected = expected / np.maximum(where.sum(-1, keepdims=True), 1)
    else:
        expected = np.where(where, -adv, 0.0)
    assert_close(grad, expected, rtol=1e-6, atol=1e-7)
    reinforce = grad_logps(lambda x: -jnp.asarray(adv) * x * where, logps)
    if level != "sequence":
        assert_close(grad, reinforce, rtol=1e-6)
    # Also off-policy data whose behaviour log-probs equal the current ones.
    same = grad_logps(losses.policy_gradient_loss, logps, logps, adv, level="token", where=where)
    assert_close(same, np.where(where, -adv, 0.0), rtol=1e-6)


# --- Dual clip and ratio cap.


def test_dual_clip_bounds_negative_advantages():
    ratios = np.array([0.5, 1.0, 1.5, 2.9, 3.1, 50.0])
    old = np.full((2, 6), -2.0, np.float32)
    logps = (old + np.log(ratios)).astype(np.float32)
    adv = np.array([-2.0, 2.0], np.float32)
    plain = losses.policy_gradient_loss(logps, old, adv)
    dual = losses.policy_gradient_loss(logps, old, adv, dual_clip=3.0)
    r = np.exp(logps.astype(np.float64) - old)
    assert_close(dual[0], 2.0 * np.minimum(np.maximum(r[0], 0.8), 3.0), rtol=1e-6)
    assert_close(dual[1], plain[1], rtol=0, atol=0)  # positive advantages: unchanged
    grad = grad_logps(losses.policy_gradient_loss, logps, old, adv, dual_clip=3.0)
    assert_close(grad[0], np.where((r[0] > 0.8) & (r[0] < 3.0), 2.0 * r[0], 0.0), rtol=1e-6)


@given(token_problems(), st.floats(0.0, 0.5), st.floats(0.01, 3.0))
def test_ratio_cap_above_clip_range_equals_dual_clip(problem, eps_high, margin):
    logps, old, adv = problem
    cap = 1 + eps_high + margin
    kw = {"epsilon_high": eps_high}
    capped = policy_gradient_loss(logps, old, adv, ratio_cap=cap, **kw)
    dual = policy_gradient_loss(logps, old, adv, dual_clip=cap, **kw)
    assert_close(capped, dual, rtol=1e-6, atol=1e-6)
    assert_close(
        pg_grad(logps, old, adv, ratio_cap=cap, **kw),
        pg_grad(logps, old, adv, dual_clip=cap, **kw),
        rtol=1e-6,
        atol=1e-6,
    )


def test_ratio_cap_below_clip_range_caps_both_terms():
    old = np.full((1, 3), -1.0, np.float32)
    logps = (old + np.log([0.5, 1.1, 1.5])).astype(np.float32)
    out = losses.policy_gradient_loss(logps, old, np.array([1.0], np.float32), ratio_cap=1.05)
    assert_close(out, [[-0.5, -1.05, -1.05]], rtol=1e-6)


def test_log_ratio_clamp_keeps_ratios_finite():
    logps = np.array([[0.0, -200.0, 0.0]], np.float32)
    old = np.array([[-200.0, 0.0, 0.0]], np.float32)
    ratio = losses.importance_ratio(logps, old, log_ratio_clamp=20.0)
    assert_close(ratio, [[np.exp(20.0), np.exp(-20.0), 1.0]], rtol=1e-6)
    grad = grad_logps(losses.importance_ratio, logps, old, log_ratio_clamp=20.0)
    assert_close(grad, [[0.0, 0.0, 1.0]], rtol=0, atol=0)  # no gradient beyond the clamp
    loss = losses.policy_gradient_loss(logps, old, np.array([-1.0], np.float32))
    assert np.all(np.isfinite(loss))


# --- CISPO.


@given(token_problems(), st.floats(0.0, 2.0), st.floats(0.0, 4.0))
def test_cispo_gradient_is_clipped_weight_times_advantage(problem, eps_low, eps_high):
    logps, old, adv = problem
    kw = {"epsilon_low": eps_low, "epsilon_high": eps_high}
    grad = cispo_grad(logps, old, adv, **kw)
    weight = np.clip(np.exp(logps.astype(np.float64) - old), 1 - eps_low, 1 + eps_high)
    assert_close(grad, -weight * adv, rtol=1e-4, atol=1e-6)
    # Unlike the clipped surrogate, no token with a nonzero advantage loses its gradient.
    assert np.all((np.asarray(grad) != 0) | (np.abs(adv) < 1e-30))


def test_cispo_on_policy_and_unclipped_match_the_policy_gradient():
    logps, old, adv, where = gspo_problem(seed=5)
    on = grad_logps(losses.cispo_loss, logps, logps, adv, where=where)
    assert_close(on, np.where(where, -adv[:, None], 0.0), rtol=1e-6)
    wide = {"epsilon_low": 1.0, "epsilon_high": 1e3, "where": where}
    assert_close(
        grad_logps(losses.cispo_loss, logps, old, adv, **wide),
        grad_logps(losses.policy_gradient_loss, logps, old, adv, **wide),
        rtol=1e-5,
    )


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_cispo_ratio_cap_is_trls_epsilon_high(level):
    """TRL's CISPO: loss = -clamp(coef_1, max=epsilon_high).detach() * A * logp, with coef_1
    the token ratio or exp of the row's mean log-ratio; no lower bound."""
    logps, old, adv, where = gspo_problem(seed=8)
    old = (old + np.linspace(-2.0, 2.0, old.size).reshape(old.shape)).astype(np.float32)
    trl_epsilon_high = 1.5
    log_ratio = logps.astype(np.float64) - old
    if level == "sequence":
        mean = np.where(where, log_ratio, 0).sum(-1, keepdims=True) / where.sum(-1, keepdims=True)
        log_ratio = np.broadcast_to(mean, log_ratio.shape)
    weight = np.minimum(np.exp(log_ratio), trl_epsilon_high)
    assert np.any(weight == trl_epsilon_high) and np.any(weight < 1)  # both sides occur
    expected_grad = np.where(where, -weight * adv[:, None], 0.0)
    kw = {"level": level, "ratio_cap": trl_epsilon_high, "where": where}
    out = losses.cispo_loss(logps, old, adv, **kw)
    assert_close(out, np.where(where, expected_grad * logps, 0.0), rtol=1e-5, atol=1e-6)
    assert_close(grad_logps(losses.cispo_loss, logps, old, adv, **kw), expected_grad, rtol=1e-5)
    # The weight carries no gradient, so GSPO-token's ratio gives exactly GSPO's loss.
    if level == "sequence":
        kw["level"] = "sequence_token"
        assert_close(losses.cispo_loss(logps, old, adv, **kw), out, rtol=0, atol=0)


def test_cispo_relative_and_absolute_caps_agree():
    logps, old, adv, where = gspo_problem(seed=9)
    old = (old - 2.0).astype(np.float32)  # every ratio above e^1.7 > 4, the default cap
    default = losses.cispo_loss(logps, old, adv, where=where)
    assert_close(losses.cispo_loss(logps, old, adv, ratio_cap=4.0, where=where), default)
    assert_close(
        grad_logps(losses.cispo_loss, logps, old, adv, where=where),
        np.where(where, -4.0 * adv[:, None], 0.0),
        rtol=1e-6,
    )
    with raises_naming("epsilon_high", "ratio_cap", error=ValueError):
        losses.cispo_loss(logps, old, adv, epsilon_high=3.0, ratio_cap=4.0)


# --- SAPO.


def test_sapo_sequence_level_is_trls_and_spreads_the_gradient():
    """TRL's sequence-level SAPO: the gate of s_i = exp(mean log-ratio), one term per
    sequence (its per-sequence token mean of a constant row)."""
    logps, old, adv, where = gspo_problem(seed=10)
    n = where.sum(-1)
    mean = np.where(where, logps.astype(np.float64) - old, 0).sum(-1) / n
    s = np.exp(mean)
    tau = np.where(adv > 0, 1.0, 1.05)
    p = ref.sigmoid(tau * (s - 1))
    trl = -(4 / tau * p * adv).mean()

    def objective(x, level):
        per_token = losses.sapo_loss(x, old, adv, level=level, where=where)
        return losses.aggregate(per_token, mode="seq_mean_token_mean", where=where).mean()

    value, grad = jax.value_and_grad(objective)(jnp.asarray(logps), "sequence")
    assert_close(value, trl, rtol=1e-6)
    # d/d logp_t of -(4/tau) sigma(tau (s - 1)) A / B = -4 p (1 - p) A s / (|y_i| B) per token.
    per_row = -4 * p * (1 - p) * adv * s / n / len(adv)
    assert_close(grad, np.where(where, per_row[:, None], 0.0), rtol=1e-5, atol=1e-8)
    # GSPO-token: each token differentiates through its own log-prob only; with one advantage
    # per sequence and the per-sequence mean, the value and gradient are GSPO's.
    value_tok, grad_tok = jax.value_and_grad(objective)(jnp.asarray(logps), "sequence_token")
    assert_close(value_tok, value, rtol=1e-7)
    assert_close(grad_tok, grad, rtol=1e-5, atol=1e-8)
    own = grad_logps(losses.sapo_loss, logps, old, adv, level="sequence_token", where=where)
    assert_close(own, np.where(where, (-4 * p * (1 - p) * adv * s)[:, None], 0.0), rtol=1e-5)


@given(token_problems(), st.floats(0.1, 3.0), st.floats(0.1, 3.0))
def test_sapo_gradient_is_the_soft_gate_weight(problem, tau_pos, tau_neg):
    logps, old, adv = problem
    kw = {"tau_pos": tau_pos, "tau_neg": tau_neg}
    loss = sapo_loss(logps, old, adv, **kw)
    grad = sapo_grad(logps, old, adv, **kw)
    r = np.exp(logps.astype(np.float64) - old)
    tau = np.where(adv > 0, tau_pos, tau_neg)
    p = ref.sigmoid(tau * (r - 1))
    assert_close(grad, -4 * p * (1 - p) * r * adv, rtol=1e-4, atol=1e-5)
    # Bounded by 4 |A| / tau.
    assert np.all(np.abs(np.asarray(loss, np.float64)) <= 4 * np.abs(adv) / tau * (1 + 1e-6))


def test_sapo_on_policy_and_small_temperature_limits():
    logps, old, adv, where = gspo_problem(seed=6)
    adv_t = np.broadcast_to(adv[:, None], (4, 6))
    tau = np.where(adv_t > 0, 1.0, 1.05)
    # On-policy the weight is 1: the gradient is -A, the value -2 A / tau.
    assert_close(
        losses.sapo_loss(logps, logps, adv, where=where), np.where(where, -2 * adv_t / tau, 0)
    )
    on = grad_logps(losses.sapo_loss, logps, logps, adv, where=where)
    assert_close(on, np.where(where, -adv_t, 0.0), rtol=1e-6)
    # As tau -> 0 the gate becomes linear: the unclipped gradient -r A.
    small = {"tau_pos": 1e-3, "tau_neg": 1e-3, "where": where}
    wide = {"epsilon_low": 1.0, "epsilon_high": 1e3, "where": where}
    assert_close(
        grad_logps(losses.sapo_loss, logps, old, adv, **small),
        grad_logps(losses.policy_gradient_loss, logps, old, adv, **wide),
        rtol=1e-3,
        atol=1e-6,
    )


def test_sapo_temperature_follows_the_advantage_sign():
    logps, old, _, where = gspo_problem(seed=7)
    positive = np.array([1.0, 2.0, 0.5, 1.0], np.float32)
    base = losses.sapo_loss(logps, old, positive, where=where)
    other = losses.sapo_loss(logps, old, positive, tau_neg=3.0, where=where)
    assert_close(other, base, rtol=0, atol=0)
    changed = losses.sapo_loss(logps, old, positive, tau_pos=3.0, where=where)
    assert not np.allclose(changed, base)
    # A larger temperature decays the weight faster away from r = 1.
    far = (old + np.log(2.0)).astype(np.float32)
    slow = grad_logps(losses.sapo_loss, far, old, -positive, tau_neg=1.0, where=where)
    fast = grad_logps(losses.sapo_loss, far, old, -positive, tau_neg=2.0, where=where)
    assert np.all(np.abs(fast)[where] < np.abs(slow)[where])


# --- Argument checks.


def test_hyperparameter_errors():
    logps = np.zeros((2, 3), np.float32)
    adv = np.ones(2, np.float32)
    with raises_naming("level", "sequence_token"):
        losses.importance_ratio(logps, logps, level="seq")
    with raises_naming("level"):
        losses.policy_gradient_loss(logps, logps, adv, level="geometric")
    with own_checks():
        for fn in (losses.policy_gradient_loss, losses.cispo_loss):
            for name in ("epsilon_low", "epsilon_high"):
                with raises_naming(name, error=ValueError):
                    fn(logps, logps, adv, **{name: -0.1})
        for kw in ({"dual_clip": 1.0}, {"ratio_cap": 0.0}, {"log_ratio_clamp": 0.0}):
            with raises_naming(*kw, error=ValueError):
                losses.policy_gradient_loss(logps, logps, adv, **kw)
        for name in ("tau_pos", "tau_neg", "log_ratio_clamp"):
            with raises_naming(name, error=ValueError):
                losses.sapo_loss(logps, logps, adv, **{name: 0.0})
        with raises_naming("ratio_cap", error=ValueError):
            losses.cispo_loss(logps, logps, adv, ratio_cap=0.0)
        for fn in (losses.cispo_loss, losses.sapo_loss):
            with raises_naming("level", "sequence_token", error=ValueError):
                fn(logps, logps, adv, level="geometric")
        with raises_naming("log_ratio_clamp", error=ValueError):
            losses.importance_ratio(logps, logps, log_ratio_clamp=-1.0)
