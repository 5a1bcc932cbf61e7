import decimal
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
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
from tunelib import losses
from tunelib.losses import KL_ESTIMATORS

kl_penalty = jax.jit(
    losses.kl_penalty, static_argnames=("estimator", "level", "stop_gradient_weight")
)
LEVELS = ("token", "sequence", "sequence_token")


def ref_kl(
    logps,
    ref_logps,
    estimator,
    log_ratio_clamp=20.0,
    estimate_clamp=None,
    old=None,
    level="token",
    where=None,
):
    """Float64 reference from Schulman's definitions, with r = pi_ref / pi_theta; the
    importance weight pi_theta / pi_old per token, or at sequence level GSPO's ratio, the
    exponential of the mean log-ratio over the valid tokens of the row (TRL's
    use_bias_correction_kl with importance_sampling_level="sequence")."""
    logps, ref_logps = np.asarray(logps, np.float64), np.asarray(ref_logps, np.float64)
    log_r = np.clip(ref_logps - logps, -log_ratio_clamp, log_ratio_clamp)
    r = np.exp(log_r)
    k = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": (r - 1) - log_r}[estimator]
    if estimate_clamp is not None:
        k = np.clip(k, -estimate_clamp, estimate_clamp)
    if old is not None:
        log_w = logps - np.asarray(old, np.float64)
        if level != "token":
            valid = np.ones(log_w.shape, bool) if where is None else np.asarray(where, bool)
            total = np.where(valid, log_w, 0.0).sum(-1, keepdims=True)
            log_w = np.broadcast_to(total / np.maximum(valid.sum(-1, keepdims=True), 1), k.shape)
        k = np.exp(np.clip(log_w, -log_ratio_clamp, log_ratio_clamp)) * k
    return k


def masked(x, where):
    return np.where(where, x, np.nan).astype(np.float32)


@st.composite
def problems(draw, max_b=3, max_t=4):
    b, t = draw(st.integers(1, max_b)), draw(st.integers(1, max_t))
    logps = draw(float_arrays((b, t), -20.0, 0.0))
    ref = draw(float_arrays((b, t), -20.0, 0.0))
    old = draw(float_arrays((b, t), -20.0, 0.0))
    return logps, ref, old, draw(bool_arrays((b, t)))


def test_fixed_values():
    logps = np.array([[-1.0, -2.0, -0.5, -3.0], [-0.1, -7.0, -2.0, -0.01]], np.float32)
    ref = np.array([[-1.5, -1.0, -0.5, -0.2], [-0.3, -1.0, -2.5, -0.02]], np.float32)
    old = np.array([[-1.2, -2.5, -0.4, -3.0], [-0.1, -6.0, -2.1, -0.05]], np.float32)
    for estimator in KL_ESTIMATORS:
        assert_close(kl_penalty(logps, ref, estimator=estimator), ref_kl(logps, ref, estimator))
        assert_close(
            kl_penalty(logps, ref, estimator=estimator, old_token_logps=old),
            ref_kl(logps, ref, estimator, old=old),
        )
        assert_close(
            kl_penalty(logps, ref, estimator=estimator, estimate_clamp=0.5),
            ref_kl(logps, ref, estimator, estimate_clamp=0.5),
        )
    # verl's low_var_kl: k3 with the value clipped to [-10, 10] (here e^6 - 7 > 10).
    out = kl_penalty(logps, ref, estimator="k3", estimate_clamp=10.0)
    assert out[1, 1] == 10.0


@given(problems(), st.sampled_from(KL_ESTIMATORS), st.data())
def test_matches_reference(problem, estimator, data):
    logps, ref, old, where = problem
    clamp = data.draw(st.floats(0.5, 30.0))
    estimate_clamp = data.draw(st.none() | st.floats(0.05, 20.0))
    use_old = data.draw(st.booleans())
    level = data.draw(st.sampled_from(LEVELS)) if use_old else "token"
    out = kl_penalty(
        masked(logps, where),
        masked(ref, where),
        estimator=estimator,
        log_ratio_clamp=clamp,
        estimate_clamp=estimate_clamp,
        old_token_logps=masked(old, where) if use_old else None,
        level=level,
        where=where,
    )
    expected = ref_kl(
        logps, ref, estimator, clamp, estimate_clamp, old if use_old else None, level, where
    )
    assert out.dtype == jnp.float32
    assert_close(out, np.where(where, expected, 0.0), rtol=2e-5, atol=1e-5)


@st.composite
def equal_or_apart(draw):
    b, t = draw(st.integers(1, 3)), draw(st.integers(1, 5))
    logps = draw(float_arrays((b, t), -10.0, 0.0))
    gaps = draw(float_arrays((b, t), 2.0**-10, 10.0))
    signs = draw(st.lists(st.sampled_from([-1, 0, 1]), min_size=b * t, max_size=b * t))
    delta = gaps * np.array(signs, np.float32).reshape(b, t)
    return logps, (logps + delta).astype(np.float32)


@given(equal_or_apart())
def test_k2_k3_are_non_negative_and_zero_only_at_equal_logps(problem):
    logps, ref = problem
    equal = logps == ref
    for estimator in ("k2", "k3"):
        out = np.asarray(kl_penalty(logps, ref, estimator=estimator))
        assert np.all(out[equal] == 0)
        assert np.all(out[~equal] > 0)
    # k1 is the log-ratio itself, of either sign.
    k1 = np.asarray(kl_penalty(logps, ref, estimator="k1"))
    assert_close(k1, logps.astype(np.float64) - ref, atol=1e-6)


# Exact expectations on a small categorical policy: every support point is one "token", each
# weighted by its probability under the sampling distribution (held fixed, like a sample).


def reverse_kl(p, q):
    return np.sum(p * (np.log(p) - np.log(q)))


def grad_reverse_kl(z, q):
    """d/dz KL(softmax(z) || q) = pi * (log pi - log q - KL), from differentiating by hand."""
    p = softmax(z)
    return p * (np.log(p) - np.log(q) - reverse_kl(p, q))


def grad_forward_kl(z, q):
    """d/dz KL(q || softmax(z)) = softmax(z) - q."""
    return softmax(z) - q


def softmax(z):
    e = np.exp(z - np.max(z))
    return e / e.sum()


def expected_estimate(z, ref_logp, sample_p, estimator, old_logp=None, stop=False):
    """E_{y ~ sample_p}[estimate(y)] as a function of the policy logits z."""
    logp = jax.nn.log_softmax(z)[None]
    old = None if old_logp is None else jnp.asarray(old_logp)[None]
    # Without `stop`, the default (the paper's differentiated weight) is what is tested.
    values = losses.kl_penalty(
        logp,
        jnp.asarray(ref_logp)[None],
        estimator=estimator,
        old_token_logps=old,
        **({"stop_gradient_weight": True} if stop else {}),
    )
    return jnp.sum(jnp.asarray(sample_p) * values[0])


expected_value_and_grad = jax.jit(
    jax.value_and_grad(expected_estimate), static_argnames=("estimator", "stop")
)


@st.composite
def categoricals(draw, v=5):
    z, ref_z, old_z = (draw(float_arrays((v,), -3.0, 3.0)).astype(np.float64) for _ in range(3))
    return z, ref_z, old_z


@given(categoricals())
def test_exact_expectations_on_policy(dists):
    z, ref_z, _ = dists
    with jax.enable_x64(True):
        p, q = softmax(z), softmax(ref_z)
        kl = reverse_kl(p, q)
        values, grads = {}, {}
        for estimator in KL_ESTIMATORS:
            values[estimator], grads[estimator] = expected_value_and_grad(
                z, np.log(q), p, estimator
            )
        # k1 and k3 are unbiased for KL(pi || ref).
        assert_close(values["k1"], kl, rtol=1e-10, atol=1e-12)
        assert_close(values["k3"], kl, rtol=1e-10, atol=1e-12)
        # The k1 loss has zero expected gradient; k2's is the reverse-KL gradient; k3's is the
        # forward-KL gradient.
        assert_close(grads["k1"], np.zeros_like(z), atol=1e-12)
        assert_close(grads["k2"], grad_reverse_kl(z, q), rtol=1e-9, atol=1e-12)
        assert_close(grads["k3"], grad_forward_kl(z, q), rtol=1e-9, atol=1e-12)


def test_k3_gradient_is_not_the_reverse_kl_gradient_but_agrees_to_first_order():
    rng = np.random.default_rng(0)
    z, u = rng.normal(size=6), rng.normal(size=6)
    with jax.enable_x64(True):
        rel_errors = []
        for eps in (1.0, 1e-1, 1e-2, 1e-3):
            q = softmax(z + eps * u)
            _, g_k3 = expected_value_and_grad(z, np.log(q), softmax(z), "k3")
            true = grad_reverse_kl(z, q)
            assert np.linalg.norm(g_k3) > 0
            rel_errors.append(np.linalg.norm(g_k3 - true) / np.linalg.norm(true))
        assert rel_errors[0] > 0.1  # far from the reference: a different gradient
        # Near it the relative error shrinks like eps (first-order agreement).
        for coarse, fine in itertools.pairwise(rel_errors[1:]):
            assert 5 < coarse / fine < 20
        assert rel_errors[-1] < 1e-2


@given(categoricals(), st.booleans())
def test_importance_weighted_estimate_under_old_policy(dists, on_policy):
    z, ref_z, old_z = dists
    if on_policy:
        old_z = z  # pi_old = sg(pi_theta): the weight is 1 in value, not in gradient
    with jax.enable_x64(True):
        p, q, old = softmax(z), softmax(ref_z), softmax(old_z)
        kl = reverse_kl(p, q)
        for estimator in KL_ESTIMATORS:
            value, grad = expected_value_and_grad(z, np.log(q), old, estimator, np.log(old))
            _, grad_stopped = expected_value_and_grad(
                z, np.log(q), old, estimator, np.log(old), stop=True
            )
            if estimator == "k2":
                assert_close(grad_stopped, grad_reverse_kl(z, q), rtol=1e-9, atol=1e-12)
                continue
            # E_old[w k] = KL(pi || ref), and differentiating w gives the exact gradient.
            assert_close(value, kl, rtol=1e-10, atol=1e-12)
            assert_close(grad, grad_reverse_kl(z, q), rtol=1e-9, atol=1e-12)
            # With the weight held constant the gradient is the on-policy one of the estimator.
            expected = np.zeros_like(z) if estimator == "k1" else grad_forward_kl(z, q)
            assert_close(grad_stopped, expected, rtol=1e-9, atol=1e-12)


@given(problems(max_t=6), st.sampled_from(KL_ESTIMATORS), st.sampled_from(LEVELS), st.data())
def test_masked_equals_sliced(problem, estimator, level, data):
    logps, ref, old, _ = problem
    keep = data.draw(st.integers(0, logps.shape[1]))
    where = np.zeros(logps.shape, bool)
    where[:, :keep] = True
    out = np.asarray(
        kl_penalty(
            masked(logps, where),
            masked(ref, where),
            estimator=estimator,
            old_token_logps=masked(old, where),
            level=level,
            where=where,
        )
    )
    assert np.all(out[:, keep:] == 0)
    if keep:
        sliced = kl_penalty(
            logps[:, :keep],
            ref[:, :keep],
            estimator=estimator,
            old_token_logps=old[:, :keep],
            level=level,
        )
        np.testing.assert_allclose(out[:, :keep], sliced, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_sequence_level_weight_gradient(level):
    """d/d logp_t sum_u s k3_u = (s / n) sum_u k3_u + s (1 - r_t) at sequence level (the weight
    spreads over the row), w_t k3_t + w_t (1 - r_t) at token level; r = pi_ref / pi_theta."""
    rng = np.random.default_rng(4)
    logps, ref, old = (rng.uniform(-3, 0, (3, 5)).astype(np.float32) for _ in range(3))
    where = np.arange(5)[None, :] < np.array([[5], [2], [1]])
    k3 = ref_kl(logps, ref, "k3")
    r = np.exp(ref.astype(np.float64) - logps)
    w = ref_kl(logps, ref, "k3", old=old, level=level, where=where) / k3

    def total(x, stop=False):
        out = losses.kl_penalty(
            x, ref, old_token_logps=old, level=level, stop_gradient_weight=stop, where=where
        )
        return jnp.sum(out)

    grad = jax.grad(total)(jnp.asarray(logps))
    if level == "sequence":
        n = where.sum(-1, keepdims=True)
        spread = w * np.where(where, k3, 0).sum(-1, keepdims=True) / n
    else:
        spread = w * k3
    assert_close(grad, np.where(where, spread + w * (1 - r), 0.0), rtol=1e-5, atol=1e-6)
    stopped = jax.grad(lambda x: total(x, stop=True))(jnp.asarray(logps))
    assert_close(stopped, np.where(where, w * (1 - r), 0.0), rtol=1e-5, atol=1e-6)
    # GSPO-token's weight: the sequence value, each token differentiating through its own
    # log-prob: s k3_t + s (1 - r_t).
    if level == "sequence":
        own = jax.grad(
            lambda x: jnp.sum(
                losses.kl_penalty(x, ref, old_token_logps=old, level="sequence_token", where=where)
            )
        )(jnp.asarray(logps))
        assert_close(own, np.where(where, w * k3 + w * (1 - r), 0.0), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
@pytest.mark.parametrize("stop", [False, True])
def test_masked_tokens_have_zero_finite_gradient(estimator, stop):
    where = np.array([[True, False, True, False]])
    bad = np.array([[0.0, np.nan, 0.0, -np.inf]], np.float32)
    data = [
        np.where(where, x, bad).astype(np.float32)
        for x in ([[-1.0, 0, -2.0, 0]], [[-1.5, 0, -1.2, 0]], [[-0.5, 0, -2.5, 0]])
    ]

    def total(d):
        return jnp.sum(
            losses.kl_penalty(
                d[0],
                d[1],
                estimator=estimator,
                old_token_logps=d[2],
                stop_gradient_weight=stop,
                where=where,
            )
        )

    value, grads = jax.value_and_grad(total)(data)
    assert np.isfinite(value)
    for grad in grads:
        assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[~where] == 0)
    assert np.all(np.asarray(grads[0])[where] != 0)


def test_fully_masked_is_zero():
    nan = np.full((2, 3), np.nan, np.float32)
    where = np.zeros((2, 3), bool)
    for estimator in KL_ESTIMATORS:
        out = kl_penalty(nan, nan, estimator=estimator, old_token_logps=nan, where=where)
        assert np.all(np.asarray(out) == 0)


def test_integer_masks_count_like_boolean_masks():
    logps = np.array([[-1.0, -2.0, -0.5], [-0.3, np.nan, -4.0]], np.float32)
    ref = np.array([[-1.5, -1.0, -0.5], [-0.1, -0.2, np.nan]], np.float32)
    where = np.array([[1, 1, 0], [1, 0, 0]], np.int32)
    np.testing.assert_array_equal(
        losses.kl_penalty(logps, ref, where=where), losses.kl_penalty(logps, ref, where=where == 1)
    )
    with raises_naming("where", "2", error=ValueError):
        losses.kl_penalty(logps, ref, where=where * 2)


def test_log_ratio_clamp_keeps_exp_finite():
    logps = np.array([[-1000.0, -1.0, 0.0, -300.0]], np.float32)
    ref = np.array([[0.0, -1000.0, -1.0, -1.0]], np.float32)
    old = np.array([[-1.0, -1.0, -1.0, -1.0]], np.float32)
    for estimator in KL_ESTIMATORS:
        for clamp in (20.0, 5.0):
            out = kl_penalty(logps, ref, estimator=estimator, log_ratio_clamp=clamp)
            assert_close(out, ref_kl(logps, ref, estimator, clamp), rtol=1e-6)

            def total(x, estimator=estimator, clamp=clamp):
                return jnp.sum(
                    losses.kl_penalty(
                        x, ref, estimator=estimator, log_ratio_clamp=clamp, old_token_logps=old
                    )
                )

            value, grad = jax.value_and_grad(total)(jnp.asarray(logps))
            assert np.isfinite(value) and np.all(np.isfinite(grad))
    # The weight's log-ratio is clipped too: logp - old = 50 gives the weight e^20.
    out = kl_penalty(np.array([[0.0]]), np.array([[-1.0]]), old_token_logps=np.array([[-50.0]]))
    assert_close(out, np.exp(20.0) * (np.exp(-1.0) - 1 + 1), rtol=1e-5)


def test_bf16_inputs_are_computed_in_float32():
    rng = np.random.default_rng(1)
    logps, ref, old = (rng.uniform(-4, 0, (3, 7)).astype(np.float32) for _ in range(3))
    low = [jnp.asarray(x, jnp.bfloat16) for x in (logps, ref, old)]
    rounded = [np.asarray(x, np.float32) for x in low]
    for estimator, level in itertools.product(KL_ESTIMATORS, ("token", "sequence")):
        kw = {"estimator": estimator, "level": level}
        out = kl_penalty(low[0], low[1], old_token_logps=low[2], **kw)
        assert out.dtype == jnp.float32
        # Nothing is computed in bf16: the result is the float32 one of the rounded inputs ...
        exact = kl_penalty(*rounded[:2], old_token_logps=rounded[2], **kw)
        assert_close(out, exact, rtol=1e-6, atol=1e-7)
        # ... within the rounding of inputs to 8 significant bits (|log r| <= 4 here).
        full = kl_penalty(logps, ref, old_token_logps=old, **kw)
        assert_close(out, full, rtol=0.1, atol=0.05)


def test_float64_stays_float64():
    rng = np.random.default_rng(2)
    logps, ref, old = (rng.uniform(-5, 0, (2, 5)) for _ in range(3))
    with jax.enable_x64(True):
        for estimator in KL_ESTIMATORS:
            out = kl_penalty(logps, ref, estimator=estimator, old_token_logps=old)
            assert out.dtype == jnp.float64
            assert_close(out, ref_kl(logps, ref, estimator, old=old), rtol=1e-12, atol=1e-15)
        # k3 is accurate near log r = 0, where e^x - 1 - x cancels (reference in 40 digits).
        x = np.array([[1e-3, -1e-4, 1e-6, 0.3, -0.49, 0.51, -3.0]])
        out = kl_penalty(np.zeros_like(x), x, estimator="k3")
        assert_close(out, [[exact_k3(xi) for xi in x[0]]], rtol=1e-13, atol=0)
    x32 = np.array([[1e-3, -1e-4, 1e-6, 0.49, -0.51]], np.float32)
    out32 = kl_penalty(np.zeros_like(x32), x32, estimator="k3")
    assert_close(out32, [[exact_k3(xi) for xi in x32[0]]], rtol=3e-7, atol=0)


def exact_k3(x):
    with decimal.localcontext() as context:
        context.prec = 40
        x = decimal.Decimal(float(x))
        return float(x.exp() - 1 - x)


def test_jit_vmap_grad_and_no_retrace():
    rng = np.random.default_rng(3)
    logps, ref, old = (rng.uniform(-3, 0, (3, 4)).astype(np.float32) for _ in range(3))
    where = np.arange(4)[None, :] < np.array([[1], [4], [2]])
    expected = np.where(where, ref_kl(logps, ref, "k3", old=old), 0.0)
    assert_close(kl_penalty(logps, ref, old_token_logps=old, where=where), expected, atol=1e-7)
    mapped = jax.jit(
        jax.vmap(
            lambda a, b, c, m: losses.kl_penalty(
                a[None], b[None], old_token_logps=c[None], where=m[None]
            )[0]
        )
    )
    assert_close(mapped(logps, ref, old, where), expected, atol=1e-7)
    # d k3 / d logp = 1 - r on-policy (no weight).
    grad = jax.jit(jax.grad(lambda x: losses.kl_penalty(x, ref).sum()))(logps)
    assert_close(grad, 1 - np.exp(ref.astype(np.float64) - logps), rtol=1e-5, atol=1e-6)
    assert_traced_once(
        losses.kl_penalty,
        [
            (
                (logps, ref),
                {
                    "log_ratio_clamp": jnp.float32(c),
                    "estimate_clamp": jnp.float32(e),
                    "old_token_logps": old,
                    "where": where,
                },
            )
            for c, e in [(20.0, 10.0), (1.0, 0.1), (5.0, 3.0)]
        ],
    )
    assert_traced_once(
        lambda *a, **k: losses.kl_penalty(*a, level="sequence", **k),
        [
            ((logps, ref), {"log_ratio_clamp": jnp.float32(c), "old_token_logps": old})
            for c in (20.0, 0.5)
        ],
    )


def test_errors_name_the_argument():
    x = np.zeros((2, 3), np.float32)
    with raises_naming("ref_token_logps"):
        losses.kl_penalty(x, np.zeros((2, 4), np.float32))
    with raises_naming("estimator"):
        losses.kl_penalty(x, x, estimator="k4")
    with raises_naming("where"):
        losses.kl_penalty(x, x, where=np.ones((2, 3), np.float32))
    with own_checks():
        with raises_naming("ref_token_logps", "(2, 4)", "(2, 3)", error=ValueError):
            losses.kl_penalty(x, np.zeros((2, 4), np.float32))
        with raises_naming("old_token_logps", "(3, 2)", "(2, 3)", error=ValueError):
            losses.kl_penalty(x, x, old_token_logps=np.zeros((3, 2), np.float32))
        with raises_naming("token_logps", "[B, T]", error=ValueError):
            losses.kl_penalty(np.zeros(3, np.float32), np.zeros(3, np.float32))
        with raises_naming("token_logps", error=TypeError):
            losses.kl_penalty(np.zeros((2, 3), np.int32), x)
        with raises_naming("estimator", "k1", "k2", "k3", error=ValueError):
            losses.kl_penalty(x, x, estimator="low_var_kl")
        with raises_naming("log_ratio_clamp", error=ValueError):
            losses.kl_penalty(x, x, log_ratio_clamp=0.0)
        with raises_naming("estimate_clamp", error=ValueError):
            losses.kl_penalty(x, x, estimate_clamp=-1.0)
        with raises_naming("stop_gradient_weight", "old_token_logps", error=ValueError):
            losses.kl_penalty(x, x, stop_gradient_weight=True)
        with raises_naming("level", "old_token_logps", error=ValueError):
            losses.kl_penalty(x, x, level="sequence")
        with raises_naming("level", "sequence_token", error=ValueError):
            losses.kl_penalty(x, x, old_token_logps=x, level="geometric")
        with raises_naming("where", "(3,)", error=ValueError):
            losses.kl_penalty(x, x, where=np.ones(3, bool))
