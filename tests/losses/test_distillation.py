import decimal

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_close, assert_traced_once, float_arrays, own_checks, raises_naming
from tunelib import losses

# --- float64 NumPy references, written from the papers' formulas -----------------------------


def ref_log_softmax(logits, temperature=1.0):
    """log softmax(z / tau) in float64; `-inf` logits give `-inf`."""
    z = np.asarray(logits, np.float64) / temperature
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


def ref_kl(log_p, log_q):
    """KL(p || q) = sum_v p_v (log p_v - log q_v), with 0 log 0 = 0."""
    p = np.exp(log_p)
    safe = p > 0
    return np.where(safe, p * (np.where(safe, log_p, 0) - np.where(safe, log_q, 0)), 0).sum(-1)


def ref_forward_kl(s, t, tau=1.0, squared=True):
    scale = tau**2 if squared else 1.0
    return scale * ref_kl(ref_log_softmax(t, tau), ref_log_softmax(s, tau))


def ref_reverse_kl(s, t, tau=1.0, squared=True):
    scale = tau**2 if squared else 1.0
    return scale * ref_kl(ref_log_softmax(s, tau), ref_log_softmax(t, tau))


def ref_jsd(s, t, beta, tau=1.0, squared=True, normalize=True):
    """GKD's JSD_beta with M = beta p_T + (1 - beta) p_S; normalised by beta (1 - beta)."""
    scale = tau**2 if squared else 1.0
    if normalize and beta == 0:
        return ref_forward_kl(s, t, tau, squared)
    if normalize and beta == 1:
        return ref_reverse_kl(s, t, tau, squared)
    log_ps, log_pt = ref_log_softmax(s, tau), ref_log_softmax(t, tau)
    with np.errstate(divide="ignore"):
        log_m = np.log(beta * np.exp(log_pt) + (1 - beta) * np.exp(log_ps))
    jsd = beta * ref_kl(log_pt, log_m) + (1 - beta) * ref_kl(log_ps, log_m)
    return scale * (jsd / (beta * (1 - beta)) if normalize else jsd)


def ref_jsd_exact(s, t, beta, digits=50):
    """The normalised JSD_beta at `digits` significant digits (KL at beta = 0 and 1)."""
    decimal.getcontext().prec = digits
    beta = decimal.Decimal(beta)

    def softmax(z):
        e = [decimal.Decimal(float(x)).exp() for x in z]
        return [x / sum(e) for x in e]

    def kl(p, q):
        return sum(a * (a / b).ln() for a, b in zip(p, q, strict=True))

    out = np.zeros(s.shape[:-1])
    for idx in np.ndindex(out.shape):
        ps, pt = softmax(s[idx]), softmax(t[idx])
        if beta in (0, 1):
            out[idx] = kl(pt, ps) if beta == 0 else kl(ps, pt)
            continue
        m = [beta * a + (1 - beta) * b for a, b in zip(pt, ps, strict=True)]
        out[idx] = (beta * kl(pt, m) + (1 - beta) * kl(ps, m)) / (beta * (1 - beta))
    return out


def ref_cross_entropy(s, targets):
    return -np.take_along_axis(ref_log_softmax(s), np.asarray(targets)[..., None], -1)[..., 0]


def ref_top_k_kl(s, t, k, tau=1.0, squared=True):
    ids = np.argsort(-np.asarray(t, np.float64), axis=-1, kind="stable")[..., :k]
    log_p = ref_log_softmax(np.take_along_axis(t, ids, -1), tau)
    log_q = np.take_along_axis(ref_log_softmax(s, tau), ids, -1)
    return (tau**2 if squared else 1.0) * ref_kl(log_p, log_q)


# --- everything under one jit, so that a hypothesis example compiles once per shape ----------


@jax.jit
def all_losses(s, t, tau, beta, alpha, labels):
    top_logits, top_ids = losses.teacher_top_k(t, k=t.shape[-1] // 2 + 1)
    all_logits, all_ids = losses.teacher_top_k(t, k=t.shape[-1])
    soft_hard = {
        d: losses.soft_hard_distillation_loss(
            s, t, soft_weight=alpha, temperature=tau, divergence=d, mix=beta, targets=labels
        )
        for d in ("forward_kl", "reverse_kl", "jsd")
    }
    return {
        "forward": losses.forward_kl_loss(s, t, temperature=tau),
        "forward_plain": losses.forward_kl_loss(s, t, temperature=tau, temperature_squared=False),
        "reverse": losses.reverse_kl_loss(s, t, temperature=tau),
        "jsd": losses.generalized_jsd_loss(s, t, mix=beta, temperature=tau),
        "jsd_raw": losses.generalized_jsd_loss(s, t, mix=beta, temperature=tau, normalize=False),
        "jsd_swapped": losses.generalized_jsd_loss(t, s, mix=1 - beta, temperature=tau),
        "top_k": losses.top_k_forward_kl_loss(s, top_logits, top_ids, temperature=tau),
        "top_all": losses.top_k_forward_kl_loss(s, all_logits, all_ids, temperature=tau),
        "argmax": losses.teacher_argmax_loss(s, t),
        "soft_hard_labels": soft_hard,
        "soft_hard_argmax": losses.soft_hard_distillation_loss(
            s, t, soft_weight=alpha, temperature=tau
        ),
    }


@st.composite
def logit_pairs(draw, low=-10.0, high=10.0):
    # Few distinct shapes: `all_losses` compiles once per shape (about a second each). One
    # token or several rows; vocabularies of 2 (top-k keeps all), 3 and 5 (it keeps 2 and 3).
    shape = draw(st.sampled_from([(1, 1, 3), (2, 3, 2), (2, 3, 5)]))
    student = draw(float_arrays(shape, low, high))
    teacher = draw(float_arrays(shape, low, high))
    return student, teacher


def test_fixed_values():
    # Shapes that the hypothesis tests use too, so `all_losses` compiles nothing new.
    s = np.round(np.random.default_rng(0).normal(size=(2, 3, 5)) * 3, 1).astype(np.float32)
    t = np.round(np.random.default_rng(1).normal(size=(2, 3, 5)) * 3, 1).astype(np.float32)
    t[0, 0, 1] = t[0, 0, 3] = t[0, 0].max() + 1  # a tie for the teacher's argmax
    labels = np.array([[2, 0, 4], [1, 1, 3]])
    for tau in (1.0, 2.0, 0.5):
        for beta in (0.0, 0.1, 0.5, 0.9, 1.0):
            out = all_losses(s, t, tau, beta, 0.3, labels)
            assert_close(out["forward"], ref_forward_kl(s, t, tau))
            assert_close(out["forward_plain"], ref_forward_kl(s, t, tau, squared=False))
            assert_close(out["reverse"], ref_reverse_kl(s, t, tau))
            assert_close(out["jsd"], ref_jsd(s, t, beta, tau))
            assert_close(out["jsd_raw"], ref_jsd(s, t, beta, tau, normalize=False))
            assert_close(out["top_k"], ref_top_k_kl(s, t, 3, tau))
            assert_close(out["top_all"], ref_forward_kl(s, t, tau))
            assert_close(out["argmax"], ref_cross_entropy(s, t.argmax(-1)))
            soft = {"forward_kl": ref_forward_kl, "reverse_kl": ref_reverse_kl}
            for name, ref in soft.items():
                expected = 0.3 * ref(s, t, tau) + 0.7 * ref_cross_entropy(s, labels)
                assert_close(out["soft_hard_labels"][name], expected)
            expected = 0.3 * ref_jsd(s, t, beta, tau) + 0.7 * ref_cross_entropy(s, labels)
            assert_close(out["soft_hard_labels"]["jsd"], expected)
    # By hand: p_S = softmax([1, 0, 0]), p_T = softmax([2, 0, -1]).
    p_s = np.exp([1.0, 0, 0]) / np.exp([1.0, 0, 0]).sum()
    p_t = np.exp([2.0, 0, -1]) / np.exp([2.0, 0, -1]).sum()
    m = (p_s + p_t) / 2
    js = 0.5 * np.sum(p_t * np.log(p_t / m)) + 0.5 * np.sum(p_s * np.log(p_s / m))
    one_s, one_t = np.array([[[1.0, 0.0, 0.0]]]), np.array([[[2.0, 0.0, -1.0]]])
    out = all_losses(one_s, one_t, 1.0, 0.5, 0.5, np.array([[2]]))
    assert_close(out["forward"], [[np.sum(p_t * np.log(p_t / p_s))]])
    assert_close(out["reverse"], [[np.sum(p_s * np.log(p_s / p_t))]])
    assert_close(out["jsd_raw"], [[js]])
    assert_close(out["jsd"], [[4 * js]])
    assert_close(out["argmax"], [[-np.log(p_s[0])]])


# The reference divides by beta (1 - beta) naively: exact enough away from the ends, which
# `test_jsd_is_continuous_and_exact_at_the_ends` covers.
betas = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(1e-3, 1 - 1e-3))


@given(logit_pairs(), st.floats(0.3, 4.0), betas, st.floats(0.0, 1.0))
def test_matches_reference(pair, tau, beta, alpha):
    s, t = pair
    labels = np.zeros(s.shape[:-1], np.int32)
    out = all_losses(s, t, tau, beta, alpha, labels)
    # float32 beta, as the function sees it; the reference is exact in it.
    beta = float(np.float32(beta))
    tol = {"rtol": 1e-4, "atol": 1e-4}
    assert_close(out["forward"], ref_forward_kl(s, t, tau), **tol)
    assert_close(out["reverse"], ref_reverse_kl(s, t, tau), **tol)
    assert_close(out["jsd"], ref_jsd(s, t, beta, tau), **tol)
    assert_close(out["jsd_raw"], ref_jsd(s, t, beta, tau, normalize=False), **tol)
    assert_close(out["top_k"], ref_top_k_kl(s, t, s.shape[-1] // 2 + 1, tau), **tol)
    hard = ref_cross_entropy(s, labels)
    assert_close(out["argmax"], ref_cross_entropy(s, t.argmax(-1)), **tol)
    expected = alpha * ref_forward_kl(s, t, tau) + (1 - alpha) * hard
    assert_close(out["soft_hard_labels"]["forward_kl"], expected, **tol)


@given(logit_pairs(), st.floats(0.3, 4.0), betas, st.data())
def test_properties(pair, tau, beta, data):
    s, t = pair
    labels = np.zeros(s.shape[:-1], np.int32)
    out = {
        k: np.asarray(x)
        for k, x in all_losses(s, t, tau, beta, 0.5, labels).items()
        if k != "soft_hard_labels"
    }
    # Every divergence is >= 0, never negative through rounding (sums of non-negative terms).
    for name in ("forward", "reverse", "jsd", "jsd_raw"):
        assert np.all(out[name] >= 0), name
    assert np.all(out["top_k"] >= -1e-6)
    # tau^2 scaling: exactly tau^2 times the unscaled KL of the tempered distributions.
    assert_close(out["forward"], tau**2 * out["forward_plain"], rtol=1e-6, atol=0)
    # JSD is symmetric under swapping student and teacher with beta -> 1 - beta.
    assert_close(out["jsd_swapped"], out["jsd"], rtol=1e-4, atol=1e-5)
    # Top-k with k = V is the forward KL.
    assert_close(out["top_all"], out["forward"], rtol=1e-4, atol=1e-4)
    # Without labels, the hard part is the teacher-argmax cross-entropy.
    expected = 0.5 * out["forward"] + 0.5 * out["argmax"]
    assert_close(out["soft_hard_argmax"], expected, rtol=1e-5, atol=1e-5)
    # Adding a constant to the logits at a position changes nothing. (Shifting the teacher
    # could turn near-ties into ties and change its argmax / top k, so those shift the student.)
    shift = data.draw(float_arrays((*s.shape[:-1], 1), -30, 30))
    shifted = all_losses(s + shift, t - shift, tau, beta, 0.5, labels)
    for name in ("forward", "reverse", "jsd", "jsd_raw"):
        assert_close(shifted[name], out[name], rtol=1e-3, atol=2e-4 * tau**2)
    shifted = all_losses(s + shift, t, tau, beta, 0.5, labels)
    for name in ("top_k", "argmax"):
        assert_close(shifted[name], out[name], rtol=1e-3, atol=2e-4 * tau**2)
    # Equal distributions (identical or shifted logits) give 0.
    same = all_losses(s, s, tau, beta, 0.5, labels)
    for name in ("forward", "reverse", "jsd", "jsd_raw"):
        assert np.all(np.asarray(same[name]) == 0), name
    # (top-k normalises the teacher over its reordered logits: zero up to rounding)
    assert_close(same["top_all"], 0.0, atol=1e-6 * tau**2)
    same_shifted = all_losses(s + shift, s, tau, beta, 0.5, labels)
    for name in ("forward", "reverse", "jsd", "jsd_raw"):
        assert_close(same_shifted[name], 0.0, atol=1e-5 * tau**2)


@given(logit_pairs())
def test_zero_only_for_equal_distributions_and_jsd_bound(pair):
    s, t = pair
    ps, pt = np.exp(ref_log_softmax(s)), np.exp(ref_log_softmax(t))
    distance = np.abs(ps - pt).sum(-1)
    out = all_losses(s, t, 1.0, 0.5, 0.5, np.zeros(s.shape[:-1], np.int32))
    # Pinsker: KL >= (total variation)^2 / 2, so distinct distributions give KL > 0; the same
    # holds for the JSD (each of its KL terms is against the midpoint, at half the distance).
    for name in ("forward", "reverse"):
        assert np.all(np.asarray(out[name]) >= 0.5 * distance**2 - 1e-5), name
    assert np.all(np.asarray(out["jsd_raw"]) >= 0.5 * (distance / 2) ** 2 - 1e-5)
    # The symmetric Jensen-Shannon divergence is at most log 2.
    assert np.all(np.asarray(out["jsd_raw"]) <= np.log(2) + 1e-6)
    disjoint = np.array([[[30.0, -30.0]]], np.float32)
    raw = jax.jit(losses.generalized_jsd_loss, static_argnames="normalize")(
        disjoint, -disjoint, mix=0.5, normalize=False
    )
    assert_close(raw, [[np.log(2)]], rtol=1e-6)


@jax.jit
def kl_gradients(s, t, tau):
    """Gradients of the summed forward KL (w.r.t. both) and reverse KL (w.r.t. the student),
    with and without the tau^2 factor."""
    out = {}
    for squared in (False, True):

        def forward(x, y, squared=squared):
            return losses.forward_kl_loss(x, y, temperature=tau, temperature_squared=squared)

        def reverse(x, y, squared=squared):
            return losses.reverse_kl_loss(x, y, temperature=tau, temperature_squared=squared)

        out[squared] = (
            *jax.grad(lambda x, y, f=forward: f(x, y).sum(), argnums=(0, 1))(s, t),
            jax.grad(lambda x, f=reverse: f(x, t).sum())(s),
        )
    return out


def test_gradients_match_closed_forms():
    """d KL(p_T || p_S) / d z_S = (p_S - p_T) / tau, times tau^2 with the scaling (Hinton et al.);
    d KL(p_S || p_T) / d z_S = p_S (log p_S - log p_T - KL) / tau; and into the teacher,
    d KL(p_T || p_S) / d z_T = p_T (log p_T - log p_S - KL) / tau."""
    s = np.asarray(jax.random.normal(jax.random.key(0), (2, 3, 6)) * 2)
    t = np.asarray(jax.random.normal(jax.random.key(1), (2, 3, 6)) * 2)
    for tau in (0.5, 1.0, 4.0, 20.0):
        ls, lt = ref_log_softmax(s, tau), ref_log_softmax(t, tau)
        ps, pt = np.exp(ls), np.exp(lt)
        grads = kl_gradients(s, t, tau)
        for squared, scale in ((False, 1.0), (True, tau**2)):
            g_s, g_t, g_rev = grads[squared]
            tol = {"rtol": 1e-4, "atol": 1e-5 * scale / tau}
            assert_close(g_s, scale * (ps - pt) / tau, **tol)
            kl = ref_kl(lt, ls)[..., None]
            assert_close(g_t, scale * pt * (lt - ls - kl) / tau, **tol)
            kl = ref_kl(ls, lt)[..., None]
            assert_close(g_rev, scale * ps * (ls - lt - kl) / tau, **tol)
    # With the tau^2 factor the gradient at high temperature approaches (z_S - z_T) / V
    # (Hinton et al., eq. 3 with zero-mean logits), independent of tau.
    s0, t0 = s - s.mean(-1, keepdims=True), t - t.mean(-1, keepdims=True)
    for tau in (100.0, 1000.0):
        assert_close(kl_gradients(s0, t0, tau)[True][0], (s0 - t0) / 6, rtol=0.05, atol=0.01)


def test_jsd_gradient_matches_finite_differences():
    with jax.enable_x64(True):
        s = np.random.default_rng(0).normal(size=(1, 2, 5)) * 2
        t = np.random.default_rng(1).normal(size=(1, 2, 5)) * 2
        grad_fn = jax.jit(
            jax.grad(lambda x, b: losses.generalized_jsd_loss(x, t, mix=b, temperature=1.5).sum())
        )
        h = 1e-6
        for beta in (1e-3, 0.3, 0.5, 0.9):
            numeric = np.zeros_like(s)
            for idx in np.ndindex(s.shape):
                e = np.zeros_like(s)
                e[idx] = h
                plus = ref_jsd(s + e, t, beta, 1.5).sum()
                minus = ref_jsd(s - e, t, beta, 1.5).sum()
                numeric[idx] = (plus - minus) / (2 * h)
            assert_close(grad_fn(s, beta), numeric, rtol=1e-5, atol=1e-6)


def test_jsd_is_continuous_and_exact_at_the_ends():
    s = np.asarray(jax.random.normal(jax.random.key(2), (2, 3, 6)) * 3)
    t = np.asarray(jax.random.normal(jax.random.key(3), (2, 3, 6)) * 3)
    # Exactly the KL at the ends: the same gradient (compared in float64: the JSD's and the
    # KL's gradients are different formulas, which in float32 differ by a CPU-dependent
    # rounding, 0.47 of a fixed 1e-7 here), and the same value to the last bit.
    for beta, kl in ((0.0, "forward"), (1.0, "reverse")):
        with jax.enable_x64(True):
            grads = values_and_grads(np.float64(s), np.float64(t), np.float64(beta))
        for g_jsd, g_kl in zip(grads["jsd"][1], grads[kl][1], strict=True):
            assert g_jsd.dtype == jnp.float64 and np.all(np.isfinite(g_jsd))
            assert_close(g_jsd, g_kl, rtol=1e-13, atol=1e-15)
    s, t = s[:1, :2], t[:1, :2]
    forward = losses.forward_kl_loss(s, t)
    assert np.array_equal(losses.generalized_jsd_loss(s, t, mix=0.0), forward)
    assert np.array_equal(losses.generalized_jsd_loss(s, t, mix=1.0), losses.reverse_kl_loss(s, t))
    # Near the ends, against a 50-digit reference: float32 is as accurate as in the middle (a
    # naive formula divided by beta would be off by ~1e-7 / beta), float64 to ~1e-13.
    for beta in (1e-6, 1e-3, 1 - 2.0**-20, 1 - 1e-3):
        exact = ref_jsd_exact(s, t, float(np.float32(beta)))
        assert_close(losses.generalized_jsd_loss(s, t, mix=beta), exact, rtol=2e-6)
    with jax.enable_x64(True):
        s64, t64 = s.astype(np.float64), t.astype(np.float64)
        forward64 = ref_jsd_exact(s64, t64, 0.0)
        reverse64 = ref_jsd_exact(s64, t64, 1.0)
        kls = jax.jit(lambda s, t: (losses.forward_kl_loss(s, t), losses.reverse_kl_loss(s, t)))
        forward, reverse = kls(s64, t64)
        assert_close(forward, forward64, rtol=1e-14)
        assert_close(reverse, reverse64, rtol=1e-14)
        jsd = jax.jit(losses.generalized_jsd_loss)  # the mix is traced: one compilation
        for beta in (1e-12, 1e-9, 1e-6, 1e-3, 1 - 1e-6):
            exact = ref_jsd_exact(s64, t64, beta)
            assert_close(jsd(s64, t64, mix=beta), exact, rtol=1e-13)
        # The distance to the KL limit shrinks like O(beta): (J(beta) - KL) / beta converges.
        slopes = [(np.asarray(jsd(s64, t64, mix=b)) - forward64) / b for b in (1e-12, 1e-9)]
        assert_close(slopes[1], slopes[0], rtol=1e-3, atol=1e-3)
        slopes = [
            (np.asarray(jsd(s64, t64, mix=1 - b)) - reverse64) / b
            for b in (2.0**-40, 2.0**-30)  # 1 - b exact
        ]
        assert_close(slopes[1], slopes[0], rtol=1e-3, atol=1e-3)


# Per-token losses of (student, teacher, beta); `values_and_grads` differentiates each sum.
CASES = {
    "forward": lambda x, y, _: losses.forward_kl_loss(x, y),
    "reverse": lambda x, y, _: losses.reverse_kl_loss(x, y),
    "jsd": lambda x, y, beta: losses.generalized_jsd_loss(x, y, mix=beta),
    "argmax": lambda x, y, _: losses.teacher_argmax_loss(x, y),
    "soft_hard": lambda x, y, beta: losses.soft_hard_distillation_loss(
        x, y, divergence="jsd", mix=beta
    ),
    "top_k": lambda x, y, _: losses.top_k_forward_kl_loss(
        x, *losses.teacher_top_k(y, k=y.shape[-1])
    ),
}


@jax.jit
def values_and_grads(s, t, beta):
    return {
        name: jax.value_and_grad(lambda x, y, f=fn: f(x, y, beta).sum(), argnums=(0, 1))(s, t)
        for name, fn in CASES.items()
    }


def ref_cases(s, t, beta):
    hard = ref_cross_entropy(s, np.argmax(t, -1))
    return {
        "forward": ref_forward_kl(s, t),
        "reverse": ref_reverse_kl(s, t),
        "jsd": ref_jsd(s, t, beta),
        "argmax": hard,
        "soft_hard": 0.5 * ref_jsd(s, t, beta, 2.0) + 0.5 * hard,
        "top_k": ref_forward_kl(s, t),
    }


def test_forbidden_tokens():
    s = np.asarray(jax.random.normal(jax.random.key(4), (2, 3, 6)) * 2)
    t = np.asarray(jax.random.normal(jax.random.key(5), (2, 3, 6)) * 2)
    banned_s, banned_t = s.copy(), t.copy()
    banned_s[..., [1, 4]] = -np.inf
    banned_t[..., [1, 4]] = -np.inf
    kept = [0, 2, 3, 5]
    only_t = t.copy()
    only_t[..., 2] = -np.inf
    for beta in (0.0, 1e-6, 0.4, 1.0):
        # A token forbidden in both is as if it were not in the vocabulary (top-k keeps them).
        expected = ref_cases(s[..., kept], t[..., kept], beta)
        for name, (value, grads) in values_and_grads(banned_s, banned_t, beta).items():
            assert_close(value, expected[name].sum(), rtol=1e-5)
            assert np.all(np.isfinite(grads[0])) and np.all(np.isfinite(grads[1])), name
            assert np.all(np.asarray(grads[0])[..., [1, 4]] == 0), name
            assert np.any(np.asarray(grads[0])[..., kept] != 0), name
        # A token only the teacher forbids: everything but the reverse KL (and the JSD at
        # beta = 1, which is the reverse KL) stays finite, with finite gradients; the reverse
        # KL is infinite, since the student has mass where the teacher has none.
        expected = ref_cases(s, only_t, beta)
        out = values_and_grads(s, only_t, beta)
        assert np.isposinf(out["reverse"][0])
        for name in ("forward", "argmax", "top_k", *(("jsd", "soft_hard") if beta < 1 else ())):
            value, grads = out[name]
            assert_close(value, expected[name].sum(), rtol=1e-5)
            assert np.all(np.isfinite(grads[0])) and np.all(np.isfinite(grads[1])), name
    assert np.isposinf(values_and_grads(s, only_t, 1.0)["jsd"][0])


@jax.jit
def masked_losses(s, t, labels, top_logits, top_ids, where):
    return {
        "forward": losses.forward_kl_loss(s, t, temperature=2.0, where=where),
        "reverse": losses.reverse_kl_loss(s, t, where=where),
        "jsd": losses.generalized_jsd_loss(s, t, mix=1e-4, where=where),
        "argmax": losses.teacher_argmax_loss(s, t, where=where),
        "soft_hard": losses.soft_hard_distillation_loss(
            s, t, divergence="reverse_kl", targets=labels, where=where
        ),
        "top_k": losses.top_k_forward_kl_loss(s, top_logits, top_ids, where=where),
    }


def test_masks():
    s = np.array(jax.random.normal(jax.random.key(6), (2, 4, 5)))
    t = np.array(jax.random.normal(jax.random.key(7), (2, 4, 5)))
    where = np.array([[True, True, False, False], [True, True, True, False]])
    labels = np.array([[1, 2, -100, -100], [0, 4, 4, -100]])  # ignore index where masked
    top_logits, top_ids = (np.array(x) for x in losses.teacher_top_k(t, k=3))
    s[0, 2:], t[0, 2:], top_logits[0, 2:] = -np.inf, np.nan, np.nan
    s[1, 3, :2], s[1, 3, 2:], t[1, 3], top_logits[1, 3] = np.nan, np.inf, -np.inf, np.inf
    top_ids[~where] = -1  # out of range where masked
    out = masked_losses(s, t, labels, top_logits, top_ids, where)
    # Masked equals sliced (positions 0-1 of both rows); position 2 of row 1 against the
    # references.
    part = np.s_[:, :2]
    sliced = masked_losses(s[part], t[part], labels[part], top_logits[part], top_ids[part], None)
    for name, value in sliced.items():
        assert_close(out[name][part], value, rtol=1e-6)
    one_s, one_t = s[1:, 2:3], t[1:, 2:3]
    assert_close(out["forward"][1, 2], ref_forward_kl(one_s, one_t, 2.0)[0, 0], rtol=1e-5)
    assert_close(out["jsd"][1, 2], ref_jsd(one_s, one_t, 1e-4)[0, 0], rtol=1e-5)
    assert_close(out["argmax"][1, 2], ref_cross_entropy(one_s, one_t.argmax(-1))[0, 0])
    for name, value in out.items():
        assert np.all(np.asarray(value)[~where] == 0), name

    def total(x, y, z):
        return sum(v.sum() for v in masked_losses(x, y, labels, z, top_ids, where).values())

    for grad in jax.jit(jax.grad(total, argnums=(0, 1, 2)))(s, t, top_logits):
        assert np.all(np.isfinite(grad))
        assert np.all(np.asarray(grad)[~where] == 0)
        assert np.any(np.asarray(grad)[where] != 0)
    nothing = masked_losses(s, t, labels, top_logits, top_ids, np.zeros_like(where))
    for name, value in nothing.items():
        assert np.all(np.asarray(value) == 0), name


def test_teacher_top_k_and_sparse_kl():
    t = np.array([[[0.5, 3.0, -1.0, 2.0, 3.0]]], np.float32)
    top_logits, top_ids = losses.teacher_top_k(t, k=3)
    assert top_ids.dtype == jnp.int32
    assert np.array_equal(top_ids, [[[1, 4, 3]]]) and np.array_equal(top_logits, [[[3, 3, 2]]])
    low, _ = losses.teacher_top_k(t.astype(jnp.bfloat16), k=2)
    assert low.dtype == jnp.bfloat16
    s = np.array([[[1.0, 0.0, 0.0, 0.5, -1.0]]], np.float32)
    out = losses.top_k_forward_kl_loss(s, top_logits, top_ids, temperature=2.0)
    assert_close(out, ref_top_k_kl(s, t, 3, 2.0))
    # It is the KL to the student renormalised on the kept ids, plus -log of their mass.
    log_p = ref_log_softmax(t[..., [1, 4, 3]])
    log_q = ref_log_softmax(s)[..., [1, 4, 3]]
    renormalised = ref_kl(log_p, log_q - np.log(np.exp(log_q).sum(-1, keepdims=True)))
    assert_close(
        losses.top_k_forward_kl_loss(s, top_logits, top_ids),
        renormalised - np.log(np.exp(log_q).sum(-1)),
    )
    # An id out of range is an error when it can be read; under jit it makes that token's loss
    # NaN instead of reading another token.
    sparse_kl = jax.jit(losses.top_k_forward_kl_loss)
    for bad in (5, -1):  # no wrap-around for negative ids either
        bad_ids = top_ids.at[0, 0, 0].set(bad)
        with raises_naming("teacher_top_ids", str(bad), "V = 5", error=ValueError):
            losses.top_k_forward_kl_loss(s, top_logits, bad_ids)
        assert np.isnan(sparse_kl(s, top_logits, bad_ids)[0, 0])


def test_bf16_close_to_float32():
    s = jax.random.normal(jax.random.key(8), (2, 3, 5)) * 3
    t = jax.random.normal(jax.random.key(9), (2, 3, 5)) * 3
    s16, t16 = s.astype(jnp.bfloat16), t.astype(jnp.bfloat16)
    labels = jnp.zeros((2, 3), jnp.int32)
    low = all_losses(s16, t16, 2.0, 0.3, 0.5, labels)
    rounded = all_losses(s16.astype(jnp.float32), t16.astype(jnp.float32), 2.0, 0.3, 0.5, labels)
    full = all_losses(s, t, 2.0, 0.3, 0.5, labels)
    for name in ("forward", "reverse", "jsd", "jsd_raw", "top_k", "argmax"):
        assert low[name].dtype == jnp.float32
        # Computed in float32 from the bf16 values: same as float32 on the rounded inputs.
        assert_close(low[name], rounded[name], rtol=1e-6, atol=1e-6)
    for name in ("forward", "reverse", "jsd", "jsd_raw"):
        # bf16 rounding of logits of size ~10 (2^-8 relative) moves the divergences by < 0.05.
        # (The teacher's argmax and top-k set can jump when rounding reorders near-ties.)
        assert_close(low[name], full[name], rtol=0.02, atol=0.05)


def test_float64_stays_float64():
    with jax.enable_x64(True):
        s = np.random.default_rng(0).normal(size=(2, 3, 4)) * 3
        t = np.random.default_rng(1).normal(size=(2, 3, 4)) * 3
        jsd, forward = jax.jit(
            lambda s, t: (
                losses.generalized_jsd_loss(s, t, mix=0.2, temperature=1.5),
                losses.forward_kl_loss(s, t),
            )
        )(s, t)
        assert jsd.dtype == jnp.float64 and forward.dtype == jnp.float64
        assert_close(jsd, ref_jsd(s, t, 0.2, 1.5), rtol=1e-12, atol=1e-14)
        assert_close(forward, ref_forward_kl(s, t), rtol=1e-12, atol=1e-14)


def every_loss(s, t, top_logits, top_ids, tau, beta, alpha, where):
    """Every public loss with traced hyperparameters, for the no-retrace check."""
    return (
        losses.forward_kl_loss(s, t, temperature=tau, where=where),
        losses.reverse_kl_loss(s, t, temperature=tau, where=where),
        losses.generalized_jsd_loss(s, t, mix=beta, temperature=tau, where=where),
        losses.top_k_forward_kl_loss(s, top_logits, top_ids, temperature=tau, where=where),
        losses.teacher_argmax_loss(s, t, where=where),
        losses.soft_hard_distillation_loss(
            s, t, soft_weight=alpha, temperature=tau, divergence="jsd", mix=beta, where=where
        ),
    )


def test_jit_vmap_and_no_retrace():
    s = np.asarray(jax.random.normal(jax.random.key(10), (3, 4, 6)))
    t = np.asarray(jax.random.normal(jax.random.key(11), (3, 4, 6)))
    where = np.arange(4)[None, :] < np.array([[1], [4], [2]])
    # jit, with traced numbers, equals the reference (Python numbers included).
    jitted = jax.jit(losses.generalized_jsd_loss)
    for beta in (0.0, 1e-6, 0.3, 1.0):
        expected = np.where(where, ref_jsd(s, t, float(np.float32(beta)), 1.5), 0.0)
        out = jitted(s, t, mix=beta, temperature=1.5, where=where)
        assert_close(out, expected, rtol=1e-5, atol=1e-6)
    # vmap over rows equals the batched call: compared in float64, where their different
    # vectorisations agree to rounding (in float32, 0.22 of a fixed rtol 1e-6 here).
    with jax.enable_x64(True):
        s64, t64 = np.float64(s), np.float64(t)
        mapped = jax.jit(
            jax.vmap(
                lambda x, y, m: losses.generalized_jsd_loss(
                    x[None], y[None], mix=0.3, temperature=1.5, where=m[None]
                )[0]
            )
        )(s64, t64, where)
        batched = jitted(s64, t64, mix=0.3, temperature=1.5, where=where)
    assert mapped.dtype == jnp.float64
    assert_close(mapped, batched, rtol=1e-13, atol=1e-15)
    # No recompilation when the numbers (and the data) change.
    top = losses.teacher_top_k(t, k=3)
    calls = [
        ((s, t, *top, jnp.float32(tau), jnp.float32(beta), jnp.float32(alpha), where), {})
        for tau, beta, alpha in ((0.5, 0.0, 0.1), (2.0, 0.5, 0.9), (1.0, 1.0, 0.5))
    ]
    calls.append(((t, s, *top, *calls[0][0][4:7], ~where), {}))
    assert_traced_once(every_loss, calls)


def test_errors_name_the_argument():
    s, t = jnp.zeros((2, 3, 5)), jnp.zeros((2, 3, 5))
    with raises_naming("teacher_logits"):
        losses.forward_kl_loss(s, jnp.zeros((2, 3, 4)))
    with raises_naming("student_logits"):
        losses.reverse_kl_loss(jnp.zeros((2, 3, 5), int), t)
    with raises_naming("where"):
        losses.generalized_jsd_loss(s, t, where=jnp.ones((2, 3)))
    with raises_naming("teacher_top_ids"):
        losses.top_k_forward_kl_loss(s, jnp.zeros((2, 3, 2)), jnp.zeros((2, 3, 2)))
    with own_checks():
        with raises_naming("teacher_logits", "(2, 3, 4)", "(2, 3, 5)", error=ValueError):
            losses.forward_kl_loss(s, jnp.zeros((2, 3, 4)))
        with raises_naming("teacher_logits", error=TypeError):
            losses.teacher_argmax_loss(s, jnp.zeros((2, 3, 5), int))
        with raises_naming("where", "(2, 4)", error=ValueError):
            losses.reverse_kl_loss(s, t, where=jnp.ones((2, 4), bool))
        with raises_naming("temperature", error=ValueError):
            losses.forward_kl_loss(s, t, temperature=0.0)
        with raises_naming("mix", error=ValueError):
            losses.generalized_jsd_loss(s, t, mix=1.5)
        with raises_naming("soft_weight", error=ValueError):
            losses.soft_hard_distillation_loss(s, t, soft_weight=-0.1)
        with raises_naming("divergence", "jsd", error=ValueError):
            losses.soft_hard_distillation_loss(s, t, divergence="js")
        with raises_naming("targets", "(2, 4)", error=ValueError):
            losses.soft_hard_distillation_loss(s, t, targets=jnp.zeros((2, 4), int))
        with raises_naming("targets", error=TypeError):
            losses.soft_hard_distillation_loss(s, t, targets=jnp.zeros((2, 3)))
        with raises_naming("k", "V = 5", error=ValueError):
            losses.teacher_top_k(t, k=6)
        with raises_naming("k", error=ValueError):
            losses.teacher_top_k(t, k=0)
        with raises_naming("teacher_top_logits", "(2, 4, 2)", error=ValueError):
            losses.top_k_forward_kl_loss(s, jnp.zeros((2, 4, 2)), jnp.zeros((2, 4, 2), int))
        with raises_naming("teacher_top_logits", "k = 6", error=ValueError):
            losses.top_k_forward_kl_loss(s, jnp.zeros((2, 3, 6)), jnp.zeros((2, 3, 6), int))
        with raises_naming("teacher_top_ids", "(2, 3, 3)", error=ValueError):
            losses.top_k_forward_kl_loss(s, jnp.zeros((2, 3, 2)), jnp.zeros((2, 3, 3), int))
        with raises_naming("teacher_top_ids", error=TypeError):
            losses.top_k_forward_kl_loss(s, jnp.zeros((2, 3, 2)), jnp.zeros((2, 3, 2)))


def test_integer_masks_and_ids_outside_the_vocabulary():
    s = np.array(jax.random.normal(jax.random.key(6), (2, 4, 5)))
    t = np.array(jax.random.normal(jax.random.key(7), (2, 4, 5)))
    where = np.array([[1, 1, 0, 0], [1, 1, 1, 0]])
    labels = np.array([[1, 2, -100, -100], [0, 4, 4, -100]])
    top_logits, top_ids = (np.array(x) for x in losses.teacher_top_k(t, k=3))
    boolean = masked_losses(s, t, labels, top_logits, top_ids, where == 1)
    integer = masked_losses(s, t, labels, top_logits, top_ids, where)
    for name, value in boolean.items():
        np.testing.assert_array_equal(integer[name], value, err_msg=name)
    with raises_naming("where", "2", error=ValueError):
        losses.forward_kl_loss(s, t, where=where * 2)
    top_ids[0, 1, 2] = 5
    with raises_naming("teacher_top_ids", "5", "V = 5", error=ValueError):
        losses.top_k_forward_kl_loss(s, top_logits, top_ids)
    with raises_naming("targets", "-100", "V = 5", error=ValueError):
        losses.soft_hard_distillation_loss(s, t, targets=labels)
