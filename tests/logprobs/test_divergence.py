"""`token_divergence` (tunelib/logprobs/_divergence.py) against float64 references.

The distillation losses are tau^2 times these values; tests/losses/test_distillation.py checks
their numerics in depth (tiny mixture weights, forbidden tokens, swaps).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests._helpers import assert_close, assert_traced_once, own_checks, raises_naming
from tests.logprobs.test_fused_divergence import ref_loss
from tunelib import logprobs

token_divergence = jax.jit(logprobs.token_divergence, static_argnames=("divergence", "normalize"))


def logits(seed, shape=(2, 3, 6)):
    return np.asarray(jax.random.normal(jax.random.key(seed), shape) * 2, np.float32)


@pytest.mark.parametrize("divergence", logprobs.DIVERGENCES)
def test_matches_reference_and_masks(divergence):
    s, t = logits(0), logits(1)
    where = np.array([[True, True, False], [True, False, True]])
    for mix, normalize in ((0.0, True), (0.3, True), (0.3, False), (1.0, True)):
        options = {"divergence": divergence, "mix": mix, "normalize": normalize}
        out = token_divergence(s, t, temperature=1.7, where=where, **options)
        expected = ref_loss(s.reshape(6, 6), t.reshape(6, 6), divergence, mix, 1.7, normalize)
        assert_close(out, np.where(where, expected.reshape(2, 3), 0.0), rtol=1e-5, atol=1e-6)
        if divergence != "jsd":
            break
    # Masked positions give 0 and no gradient, whatever their logits; integer masks count too.
    bad = np.where(where[..., None], s, np.nan).astype(np.float32)
    value, grad = jax.value_and_grad(
        lambda x: token_divergence(x, t, divergence=divergence, where=where).sum()
    )(bad)
    assert np.isfinite(value) and np.all(np.asarray(grad)[~where] == 0)
    integer = token_divergence(bad, t, divergence=divergence, where=where.astype(np.int32))
    np.testing.assert_array_equal(
        integer, token_divergence(bad, t, divergence=divergence, where=where)
    )


def test_properties_dtypes_and_no_retrace():
    s, t = logits(2), logits(3)
    same = token_divergence(s, s, divergence="jsd", mix=0.4)
    assert np.all(np.asarray(same) == 0)
    swapped = token_divergence(t, s, divergence="jsd", mix=0.7)
    assert_close(swapped, token_divergence(s, t, divergence="jsd", mix=0.3), rtol=1e-5, atol=1e-7)
    assert token_divergence(s.astype(jnp.bfloat16), t).dtype == jnp.float32
    with jax.enable_x64(True):
        wide = token_divergence(s.astype(np.float64), t.astype(np.float64), temperature=2.0)
        assert wide.dtype == jnp.float64
        expected = ref_loss(s.reshape(6, 6), t.reshape(6, 6), "forward_kl", tau=2.0)
        assert_close(wide, expected.reshape(2, 3), rtol=1e-12)
    assert_traced_once(
        lambda a, b, m, tau: logprobs.token_divergence(
            a, b, divergence="jsd", mix=m, temperature=tau
        ),
        [((s, t, jnp.float32(m), jnp.float32(tau)), {}) for m, tau in ((0.2, 1.0), (0.9, 3.0))],
    )


def test_errors_name_the_argument():
    s, t = jnp.zeros((2, 3, 5)), jnp.zeros((2, 3, 5))
    with raises_naming("teacher_logits"):
        logprobs.token_divergence(s, jnp.zeros((2, 3, 4)))
    with raises_naming("where"):
        logprobs.token_divergence(s, t, where=jnp.ones((2, 3)))
    with own_checks():
        with raises_naming("teacher_logits", "(2, 3, 4)", error=ValueError):
            logprobs.token_divergence(s, jnp.zeros((2, 3, 4)))
        with raises_naming("student_logits", error=TypeError):
            logprobs.token_divergence(jnp.zeros((2, 3, 5), int), t)
        with raises_naming("divergence", "jsd", error=ValueError):
            logprobs.token_divergence(s, t, divergence="js")
        with raises_naming("mix", error=ValueError):
            logprobs.token_divergence(s, t, divergence="jsd", mix=1.5)
        with raises_naming("temperature", error=ValueError):
            logprobs.token_divergence(s, t, temperature=0.0)
    # The mixture weight is only the JSD's: ignored, and unchecked, by the KLs.
    np.testing.assert_array_equal(
        logprobs.token_divergence(s, t, mix=1.5), logprobs.token_divergence(s, t)
    )
