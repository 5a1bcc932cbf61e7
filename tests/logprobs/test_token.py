import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import (
    assert_close,
    assert_traced_once,
    float_arrays,
    own_checks,
    raises_naming,
)
from tunelib import logprobs

# Jitted once per shape: hypothesis draws many shapes, and one compilation per shape is far
# cheaper than op-by-op dispatch.
token_logps = jax.jit(logprobs.token_logps)
token_entropy = jax.jit(logprobs.token_entropy)


def ref_log_softmax(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = np.asarray(logits, np.float64) / temperature
    m = z.max(axis=-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(axis=-1, keepdims=True))


def ref_token_logps(logits, targets, temperature=1.0):
    logp = ref_log_softmax(logits, temperature)
    return np.take_along_axis(logp, np.asarray(targets)[..., None], axis=-1)[..., 0]


def ref_entropy(logits, temperature=1.0):
    logp = ref_log_softmax(logits, temperature)
    p = np.exp(logp)
    return -np.sum(np.where(p > 0, p * logp, 0.0), axis=-1)


@st.composite
def logits_and_targets(draw, max_b=3, max_t=5, max_v=7):
    b, t, v = draw(st.integers(1, max_b)), draw(st.integers(1, max_t)), draw(st.integers(2, max_v))
    logits = draw(float_arrays((b, t, v)))
    targets = draw(float_arrays((b, t), 0, v - 1)).astype(np.int32)
    return logits, targets


def test_fixed_values():
    logits = np.array([[[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]]], np.float32)
    targets = np.array([[0, 2]])
    for temperature in (1.0, 0.7, 2.5):
        # float32's rounding: log-softmax rounds about ten times (the division, the max's
        # subtraction, V exponentials and their sum, a log, the last subtraction), each by at
        # most a few ulps (XLA's exp and log on CPU are polynomials, a few ulps at most) of
        # values up to max|z| / tau + log V: 32 of those bound it; the entropy, a mean of the
        # log-probs, too. (The fixed 1e-6 it replaces was 2 ulps of these values.)
        ulps = 32 * 2.0**-24 * (np.abs(logits).max() / temperature + np.log(3))
        assert_close(
            token_logps(logits, targets, temperature=temperature),
            ref_token_logps(logits, targets, temperature),
            rtol=0,
            atol=ulps,
        )
        assert_close(
            token_entropy(logits, temperature=temperature),
            ref_entropy(logits, temperature),
            rtol=0,
            atol=ulps,
        )


@given(logits_and_targets(), st.floats(0.2, 4.0))
def test_matches_reference(data, temperature):
    logits, targets = data
    assert_close(
        token_logps(logits, targets, temperature=temperature),
        ref_token_logps(logits, targets, temperature),
        rtol=1e-5,
        atol=1e-4,
    )
    assert_close(
        token_entropy(logits, temperature=temperature),
        ref_entropy(logits, temperature),
        rtol=1e-4,
        atol=1e-4,
    )


@given(logits_and_targets(), st.floats(-50, 50))
def test_properties(data, shift):
    logits, _ = data
    v = logits.shape[-1]
    every_target = np.broadcast_to(np.arange(v), logits.shape).transpose(2, 0, 1)
    logps = np.stack([np.asarray(token_logps(logits, t)) for t in every_target], -1)
    assert np.all(logps <= 1e-6)
    # The log-probs of all V targets form a distribution.
    assert_close(np.log(np.exp(logps.astype(np.float64)).sum(-1)), 0.0, atol=1e-5)
    # Adding a constant to every logit at a position changes nothing.
    shifted = logits + np.float32(shift)
    assert_close(token_logps(shifted, every_target[0]), logps[..., 0], atol=2e-4)
    entropy = np.asarray(token_entropy(logits))
    assert np.all(entropy >= -1e-6) and np.all(entropy <= np.log(v) + 1e-5)


def test_entropy_extremes():
    assert_close(token_entropy(jnp.zeros((2, 3, 10))), np.full((2, 3), np.log(10)))
    one_hot = jnp.array([[[0.0, -jnp.inf, -jnp.inf]]])
    assert_close(token_entropy(one_hot), [[0.0]])
    grad = jax.grad(lambda x: token_entropy(x).sum())(one_hot)
    assert np.all(np.isfinite(grad))


@given(logits_and_targets(max_t=6), st.data())
def test_masked_equals_sliced(data, draw):
    logits, targets = data
    t = logits.shape[1]
    keep = draw.draw(st.integers(0, t))
    where = np.zeros(targets.shape, bool)
    where[:, :keep] = True
    masked = token_logps(logits, targets, where=where)
    assert_close(masked[:, :keep], token_logps(logits[:, :keep], targets[:, :keep]), atol=1e-6)
    assert np.all(np.asarray(masked[:, keep:]) == 0)
    ent = token_entropy(logits, where=where)
    assert_close(ent[:, :keep], token_entropy(logits[:, :keep]), atol=1e-6)
    assert np.all(np.asarray(ent[:, keep:]) == 0)


@pytest.mark.parametrize("bad", [-jnp.inf, jnp.nan, jnp.inf])
def test_masked_positions_have_zero_finite_gradient(bad):
    logits = jnp.array([[[1.0, 2.0, 0.5], [bad, bad, bad]]])
    targets = jnp.array([[1, -100]])  # an ignore index at the masked position
    where = jnp.array([[True, False]])

    def total(x):
        return token_logps(x, targets, where=where).sum() + token_entropy(x, where=where).sum()

    value, grad = jax.value_and_grad(total)(logits)
    assert np.isfinite(value)
    assert np.all(np.isfinite(grad))
    assert np.all(np.asarray(grad[0, 1]) == 0)
    assert np.any(np.asarray(grad[0, 0]) != 0)


def test_fully_masked_is_zero():
    logits = jnp.full((2, 3, 4), jnp.nan)
    where = jnp.zeros((2, 3), bool)
    assert np.all(np.asarray(token_logps(logits, jnp.zeros((2, 3), int), where=where)) == 0)
    assert np.all(np.asarray(token_entropy(logits, where=where)) == 0)


def test_gradient_is_softmax_minus_one_hot():
    logits = jax.random.normal(jax.random.key(0), (2, 3, 5))
    targets = jnp.array([[0, 4, 2], [1, 1, 3]])
    tau = 1.7
    grad = jax.grad(lambda x: token_logps(x, targets, temperature=tau).sum())(logits)
    expected = (np.eye(5)[np.asarray(targets)] - np.exp(ref_log_softmax(logits, tau))) / tau
    assert_close(grad, expected, atol=1e-6)


def test_bf16_close_to_float32():
    logits = jax.random.normal(jax.random.key(1), (4, 8, 32)) * 3
    targets = jax.random.randint(jax.random.key(2), (4, 8), 0, 32)
    low = token_logps(logits.astype(jnp.bfloat16), targets)
    assert low.dtype == jnp.float32
    exact = ref_token_logps(np.asarray(logits.astype(jnp.bfloat16), np.float32), targets)
    assert_close(low, exact, atol=1e-5)
    assert_close(low, token_logps(logits, targets), atol=0.05)
    assert_close(token_entropy(logits.astype(jnp.bfloat16)), token_entropy(logits), atol=0.05)


def test_float64_stays_float64():
    with jax.enable_x64(True):
        logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 4)))
        out = token_logps(logits, jnp.zeros((2, 3), int))
        assert out.dtype == jnp.float64
        assert_close(out, ref_token_logps(np.asarray(logits), np.zeros((2, 3), int)), rtol=1e-12)


def test_jit_vmap_grad_and_no_retrace():
    logits = jax.random.normal(jax.random.key(3), (3, 4, 6))
    targets = jax.random.randint(jax.random.key(4), (3, 4), 0, 6)
    where = jnp.arange(4)[None, :] < jnp.array([[1], [4], [2]])
    expected = logprobs.token_logps(logits, targets, temperature=0.8, where=where)
    jitted = token_logps(logits, targets, temperature=0.8, where=where)
    assert_close(jitted, expected, atol=1e-6)
    mapped = jax.vmap(
        lambda x, y, m: logprobs.token_logps(x[None], y[None], temperature=0.8, where=m[None])[0]
    )
    assert_close(mapped(logits, targets, where), expected, atol=1e-6)
    calls = [
        ((logits, targets), {"temperature": jnp.float32(t), "where": where})
        for t in (0.5, 1.0, 2.0)
    ]
    assert_traced_once(logprobs.token_logps, calls)
    assert_traced_once(
        logprobs.token_entropy, [((logits,), {"temperature": jnp.float32(t)}) for t in (0.5, 2.0)]
    )


def test_errors_name_the_argument():
    logits = jnp.zeros((2, 3, 5))
    targets = jnp.zeros((2, 3), int)
    with raises_naming("logits"):
        logprobs.token_logps(jnp.zeros((2, 3, 5), int), targets)
    with raises_naming("targets"):
        logprobs.token_logps(logits, jnp.zeros((2, 4), int))
    with raises_naming("where"):
        logprobs.token_logps(logits, targets, where=jnp.ones((2, 3)))
    with own_checks():
        with raises_naming("targets", "(2, 4)", "(2, 3)", error=ValueError):
            logprobs.token_logps(logits, jnp.zeros((2, 4), int))
        with raises_naming("targets", error=TypeError):
            logprobs.token_logps(logits, jnp.zeros((2, 3)))
        with raises_naming("where", "(3,)", error=ValueError):
            logprobs.token_entropy(logits, where=jnp.ones((3,), bool))
        with raises_naming("logits", error=TypeError):
            logprobs.token_entropy(jnp.zeros((2, 3, 5), jnp.int32))
        with raises_naming("temperature", error=ValueError):
            logprobs.token_logps(logits, targets, temperature=0.0)


def test_targets_outside_the_vocabulary():
    logits = np.zeros((1, 3, 4), np.float32)
    uniform = -np.log(4.0)
    # Concrete ids are checked: one outside [0, V) at a counted position is an error ...
    for bad in (4, -1):
        with raises_naming("targets", str(bad), "V = 4", error=ValueError):
            logprobs.token_logps(logits, np.array([[0, bad, 1]]))
    # ... and a masked position may hold anything (an ignore index).
    where = np.array([[True, False, True]])
    out = logprobs.token_logps(logits, np.array([[0, -100, 1]]), where=where)
    assert_close(out, [[uniform, 0.0, uniform]])
    # Under jit the ids cannot be read: a counted one out of range gives NaN (loud), a masked
    # one 0, and the gradient stays finite and reaches only the valid positions.
    targets = jnp.array([[0, 7, -1]])
    where = jnp.array([[True, True, False]])
    out = np.asarray(token_logps(logits, targets, where=where))
    assert_close(out[0, 0], uniform)
    assert np.isnan(out[0, 1]) and out[0, 2] == 0
    total = jax.jit(jax.grad(lambda x, y, m: jnp.nansum(logprobs.token_logps(x, y, where=m))))
    grad = total(logits, targets, where)
    assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[0, 1:] == 0)


def test_integer_masks_count_like_boolean_masks():
    logits = jax.random.normal(jax.random.key(5), (2, 3, 4))
    targets = jnp.array([[0, 3, 1], [2, 2, 0]])
    where = np.array([[True, False, True], [False, True, True]])
    for fn, args in (
        (logprobs.token_logps, (logits, targets)),
        (logprobs.token_entropy, (logits,)),
    ):
        np.testing.assert_array_equal(
            fn(*args, where=where.astype(np.int32)), fn(*args, where=where)
        )
        with raises_naming("where", "2", error=ValueError):
            fn(*args, where=np.where(where, 2, 0))
