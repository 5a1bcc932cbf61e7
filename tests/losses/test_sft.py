import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_close, assert_traced_once, float_arrays, own_checks, raises_naming
from tests.logprobs.test_token import ref_log_softmax
from tunelib import losses
from tunelib.logprobs import token_logps as _token_logps

nll_loss = jax.jit(losses.nll_loss)
token_logps = jax.jit(_token_logps)


def ref_nll(logits, targets, label_smoothing=0.0, z_loss_weight=0.0):
    """Cross-entropy against (1 - eps) * one_hot + eps / V, plus z * (log Z)^2."""
    logits = np.asarray(logits, np.float64)
    v = logits.shape[-1]
    target_dist = (1 - label_smoothing) * np.eye(v)[np.asarray(targets)] + label_smoothing / v
    log_z = np.log(np.exp(logits).sum(-1))
    return -(target_dist * ref_log_softmax(logits, 1.0)).sum(-1) + z_loss_weight * log_z**2


@st.composite
def problems(draw):
    b, t, v = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(2, 8))
    logits = draw(float_arrays((b, t, v)))
    targets = draw(float_arrays((b, t), 0, v - 1)).astype(np.int32)
    return logits, targets


def test_fixed_values():
    logits = np.array([[[3.0, 1.0, -2.0, 0.5]]], np.float32)
    for eps, z in [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-4), (0.2, 1e-2)]:
        out = nll_loss(logits, np.array([[1]]), label_smoothing=eps, z_loss_weight=z)
        assert_close(out, ref_nll(logits, [[1]], eps, z))


@given(problems(), st.floats(0, 1), st.floats(0, 0.1))
def test_matches_reference(problem, eps, z):
    logits, targets = problem
    out = nll_loss(logits, targets, label_smoothing=eps, z_loss_weight=z)
    assert_close(out, ref_nll(logits, targets, eps, z), rtol=1e-5, atol=1e-3)


@given(problems())
def test_properties(problem):
    logits, targets = problem
    plain = np.asarray(nll_loss(logits, targets))
    assert np.all(plain >= 0)
    assert_close(plain, -np.asarray(token_logps(logits, targets)), atol=1e-5)
    # eps = 1 is the cross-entropy to the uniform distribution, whatever the target.
    uniform = nll_loss(logits, targets, label_smoothing=1.0)
    assert_close(uniform, nll_loss(logits, (targets + 1) % logits.shape[-1], label_smoothing=1.0))
    # The z-loss term only adds.
    assert np.all(np.asarray(nll_loss(logits, targets, z_loss_weight=0.01)) >= plain - 1e-6)


def test_gradient_matches_closed_form():
    logits = jax.random.normal(jax.random.key(0), (2, 3, 6))
    targets = jnp.array([[0, 5, 2], [1, 1, 3]])
    eps = 0.2
    grad = jax.grad(lambda x: losses.nll_loss(x, targets, label_smoothing=eps).sum())(logits)
    target_dist = (1 - eps) * np.eye(6)[np.asarray(targets)] + eps / 6
    assert_close(grad, np.exp(ref_log_softmax(logits, 1.0)) - target_dist, atol=1e-6)


def test_masks():
    logits = jax.random.normal(jax.random.key(1), (2, 4, 5))
    logits = logits.at[:, 3].set(-jnp.inf).at[0, 2].set(jnp.nan)
    targets = jnp.array([[1, 2, -100, -100], [0, 4, 4, -100]])
    where = jnp.array([[True, True, False, False], [True, True, True, False]])
    out = nll_loss(logits, targets, label_smoothing=0.1, z_loss_weight=1e-3, where=where)
    for row, n in enumerate((2, 3)):
        sliced = nll_loss(
            logits[row : row + 1, :n],
            targets[row : row + 1, :n],
            label_smoothing=0.1,
            z_loss_weight=1e-3,
        )
        assert_close(out[row, :n], sliced[0])
        assert np.all(np.asarray(out[row, n:]) == 0)
    grad = jax.grad(lambda x: losses.nll_loss(x, targets, label_smoothing=0.1, where=where).sum())(
        logits
    )
    assert np.all(np.isfinite(grad))
    assert np.all(np.asarray(grad)[~np.asarray(where)] == 0)
    assert np.all(np.asarray(nll_loss(logits, targets, where=jnp.zeros_like(where))) == 0)


def test_bf16_and_retrace():
    logits = jax.random.normal(jax.random.key(2), (3, 5, 16)) * 2
    targets = jax.random.randint(jax.random.key(3), (3, 5), 0, 16)
    low = nll_loss(logits.astype(jnp.bfloat16), targets, label_smoothing=0.1)
    assert low.dtype == jnp.float32
    assert_close(low, nll_loss(logits, targets, label_smoothing=0.1), rtol=0.02, atol=0.03)
    assert_traced_once(
        losses.nll_loss,
        [
            (
                (logits, targets),
                {"label_smoothing": jnp.float32(e), "z_loss_weight": jnp.float32(z)},
            )
            for e, z in [(0.0, 0.0), (0.1, 1e-4)]
        ],
    )
    out = jax.vmap(lambda x, y: losses.nll_loss(x[None], y[None])[0])(logits, targets)
    assert_close(out, nll_loss(logits, targets))


def test_errors():
    logits = jnp.zeros((2, 3, 5))
    with raises_naming("logits"):
        losses.nll_loss(jnp.zeros((2, 3, 5), int), jnp.zeros((2, 3), int))
    with raises_naming("targets"):
        losses.nll_loss(logits, jnp.zeros((3, 2), int))
    with own_checks():
        with raises_naming("targets", "(3, 2)", error=ValueError):
            losses.nll_loss(logits, jnp.zeros((3, 2), int))
        with raises_naming("label_smoothing", error=ValueError):
            losses.nll_loss(logits, jnp.zeros((2, 3), int), label_smoothing=1.5)
        with raises_naming("logits", error=TypeError):
            losses.nll_loss(jnp.zeros((2, 3, 5), int), jnp.zeros((2, 3), int))


def test_targets_outside_the_vocabulary_and_integer_masks():
    logits = jax.random.normal(jax.random.key(4), (2, 4, 5))
    targets = jnp.array([[1, 2, 0, 4], [0, 4, 4, 3]])
    where = jnp.array([[1, 1, 0, 0], [1, 1, 1, 0]])
    with raises_naming("targets", "5", "V = 5", error=ValueError):
        losses.nll_loss(logits, targets.at[0, 1].set(5))
    # Masked positions may hold any id; under jit a counted id out of range gives NaN.
    bad = targets.at[0, 1].set(-7).at[0, 3].set(99)
    out = np.array(nll_loss(logits, bad, where=where))
    expected = np.asarray(nll_loss(logits, targets, where=where))
    assert np.isnan(out[0, 1]) and out[0, 3] == 0
    out[0, 1] = expected[0, 1]
    np.testing.assert_array_equal(out, expected)
    # An integer 0/1 mask counts like the boolean one; any other value is an error.
    np.testing.assert_array_equal(expected, nll_loss(logits, targets, where=where == 1))
    with raises_naming("where", "2", error=ValueError):
        losses.nll_loss(logits, targets, where=where * 2)
