"""Final-logit soft-capping in the fused head: c tanh(l / c) before the temperature."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests._helpers import assert_close, own_checks, raises_naming
from tests.logprobs.test_fused import problem
from tunelib.logprobs import fused_token_logps

CAP = 2.5  # below the largest |logit| of these problems: the cap binds


def reference(hidden, w, b, targets, tau, cap):
    """Log-probs and entropies from the formula, in float64 NumPy."""
    logits = hidden.astype(np.float64) @ w.astype(np.float64) + b.astype(np.float64)
    z = cap * np.tanh(logits / cap) / tau
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    entropy = -(np.exp(logp) * logp).sum(-1)
    return np.take_along_axis(logp, targets[:, None], -1)[:, 0], entropy


@functools.partial(jax.jit, static_argnames=("implementation", "chunk_size", "softcap"))
def values_and_grads(hidden, w, b, targets, tau, implementation, chunk_size, softcap):
    def f(hidden, w, b, tau):
        logps, entropy = fused_token_logps(
            hidden, w, targets, bias=b, temperature=tau, softcap=softcap, with_entropy=True,
            chunk_size=chunk_size, implementation=implementation,
        )  # fmt: skip
        weights = jnp.linspace(-1.0, 1.0, 2 * logps.shape[0]).reshape(2, -1)
        return jnp.sum(weights[0] * logps) + jnp.sum(weights[1] * entropy), (logps, entropy)

    return jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(hidden, w, b, tau)


def materialised_grads(hidden, w, b, targets, tau, cap):
    """Plain autodiff of the capped logits in float64: independent of the custom VJP."""
    with jax.enable_x64(True):

        def f(hidden, w, b, tau):
            z = cap * jnp.tanh((hidden @ w + b) / cap) / tau
            logp = jax.nn.log_softmax(z, axis=-1)
            logps = jnp.take_along_axis(logp, targets[:, None], -1)[:, 0]
            entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
            weights = jnp.linspace(-1.0, 1.0, 2 * logps.shape[0]).reshape(2, -1)
            return jnp.sum(weights[0] * logps) + jnp.sum(weights[1] * entropy)

        args = [np.asarray(x, np.float64) for x in (hidden, w, b)] + [np.float64(tau)]
        return [np.asarray(g) for g in jax.grad(f, argnums=(0, 1, 2, 3))(*args)]


@pytest.mark.parametrize(("shape", "chunk"), [((7, 16, 37), 16), ((12, 8, 64), 64)])
@pytest.mark.parametrize("implementation", ["chunked", "naive"])
def test_capped_values_and_gradients_equal_the_formula(shape, chunk, implementation):
    """In float64, where the tiled head and the formula, which sum in different orders, agree
    to rounding (in float32 the gradients moved by 0.25 of a fixed rtol 1e-4 on this CPU)."""
    hidden, w, targets, b = problem(*shape, bias=True, dtype=np.float64)
    hidden = hidden * 3  # logits well past the cap
    assert np.abs(hidden @ w + b).max() > 2 * CAP
    with jax.enable_x64(True):
        (_, (logps, entropy)), grads = values_and_grads(
            hidden, w, b, targets, np.float64(0.8), implementation, chunk, CAP
        )
        plain = fused_token_logps(hidden, w, targets, bias=b, temperature=0.8)
    assert logps.dtype == entropy.dtype == jnp.float64
    expected_logps, expected_entropy = reference(hidden, w, b, targets, 0.8, CAP)
    assert_close(logps, expected_logps, rtol=1e-12, atol=1e-12)
    assert_close(entropy, expected_entropy, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, materialised_grads(hidden, w, b, targets, 0.8, CAP), strict=True):
        assert_close(got, want, rtol=1e-10, atol=1e-12 * max(1.0, np.abs(want).max()))
    # The cap binds: uncapped log-probs differ.
    assert np.abs(np.asarray(plain) - expected_logps).max() > 0.1


def test_a_cap_far_above_the_logits_changes_nothing():
    """c tanh(l / c) moves each logit by at most |l|^3 / (3 c^2), so each log-prob by at most
    twice the largest of those: compared in float64, where rounding adds nothing to that."""
    hidden, w, targets, b = problem(7, 16, 37, bias=True, dtype=np.float64)
    with jax.enable_x64(True):
        capped = fused_token_logps(hidden, w, targets, bias=b, softcap=1e4, chunk_size=16)
        plain = fused_token_logps(hidden, w, targets, bias=b, chunk_size=16)
    assert capped.dtype == jnp.float64
    largest = np.abs(hidden @ w + b).max()  # 13.5 here
    assert_close(capped, plain, rtol=0, atol=2 * largest**3 / (3 * 1e4**2) + 1e-12)


def test_softcap_errors():
    hidden, w, targets, _ = problem(4, 8, 10)
    with own_checks():
        for bad in (0.0, -1.0):
            with raises_naming("softcap"):
                fused_token_logps(hidden, w, targets, softcap=bad)
        with raises_naming("softcap"):
            fused_token_logps(hidden, w, targets, softcap=float("inf"))
        with raises_naming("softcap", error=TypeError):
            fused_token_logps(hidden, w, targets, softcap="30")


@pytest.mark.parametrize("divergence", ["forward_kl", "reverse_kl", "jsd"])
def test_capped_divergence_equals_the_materialised_capped_logits(divergence):
    """Each model capped by its own c; values and student gradients against `token_divergence`
    of the capped logits (plain autodiff), teacher gradients zero as always."""
    from tunelib.logprobs import fused_divergence, token_divergence

    rng = np.random.default_rng(3)
    h_s, w_s = rng.normal(size=(6, 8)) * 2, rng.normal(size=(8, 29))
    h_t, w_t = rng.normal(size=(6, 5)) * 2, rng.normal(size=(5, 29))
    b_s = rng.normal(size=29)
    h_s, w_s, h_t, w_t, b_s = (x.astype(np.float32) for x in (h_s, w_s, h_t, w_t, b_s))
    caps = (3.0, 2.0)

    def fused(h_s, w_s, b_s):
        return fused_divergence(
            h_s, w_s, h_t, w_t, student_bias=b_s, student_softcap=caps[0],
            teacher_softcap=caps[1], divergence=divergence, temperature=0.9, chunk_size=8,
        )  # fmt: skip

    def materialised(h_s, w_s, b_s):
        z_s = caps[0] * jnp.tanh((h_s @ w_s + b_s) / caps[0])
        z_t = caps[1] * jnp.tanh((h_t @ w_t) / caps[1])
        return token_divergence(z_s, z_t, divergence=divergence, temperature=0.9)

    weights = jnp.linspace(0.5, 1.5, 6)
    got, grads = jax.value_and_grad(lambda *a: jnp.sum(weights * fused(*a)), (0, 1, 2))(
        h_s, w_s, b_s
    )
    want, expected = jax.value_and_grad(lambda *a: jnp.sum(weights * materialised(*a)), (0, 1, 2))(
        h_s, w_s, b_s
    )
    assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, e in zip(grads, expected, strict=True):
        assert_close(g, e, rtol=1e-4, atol=1e-5)
    uncapped = fused_divergence(h_s, w_s, h_t, w_t, student_bias=b_s, divergence=divergence,
                                temperature=0.9)  # fmt: skip
    assert np.abs(np.asarray(uncapped) - np.asarray(fused(h_s, w_s, b_s))).max() > 1e-2
    with own_checks(), raises_naming("teacher_softcap"):
        fused_divergence(h_s, w_s, h_t, w_t, teacher_softcap=-1.0)
