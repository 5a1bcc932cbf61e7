import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import assume, given
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

L, B, T, E = 3, 2, 5, 6


def softmax64(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def balancing_reference(logits, top_k, where=None, pool=True, normalize=False):
    """Switch's E * sum_e f_e P_e from the formula, token by token in float64."""
    logits = np.asarray(logits, np.float64)
    layers, experts = logits.shape[0], logits.shape[-1]
    flat = logits.reshape(layers, -1, experts)
    keep = np.ones(flat.shape[1], bool) if where is None else np.asarray(where).reshape(-1)
    counts, mass = np.zeros((layers, experts)), np.zeros((layers, experts))
    tokens = np.zeros(layers)
    for layer in range(layers):
        for t in np.flatnonzero(keep):
            p = softmax64(flat[layer, t])
            for e in np.argsort(-p, kind="stable")[:top_k]:
                counts[layer, e] += 1
            mass[layer] += p
            tokens[layer] += 1
    if pool:
        counts, mass = counts.sum(0, keepdims=True), mass.sum(0, keepdims=True)
        tokens = np.array([tokens.sum()])
    c = top_k if normalize else 1
    out = np.array(
        [
            experts * np.sum(counts[i] / (c * n) * mass[i] / n) if n else 0.0
            for i, n in enumerate(tokens)
        ]
    )
    return out[0] if pool else out


logit_arrays = float_arrays((L, B, T, E), -4.0, 4.0)


@given(
    logit_arrays,
    bool_arrays((B, T)),
    st.integers(1, E),
    st.booleans(),
    st.booleans(),
)
def test_load_balancing_equals_the_float64_reference(logits, where, top_k, pool, normalize):
    # Which of two distinct logits within float32 rounding of each other is in the top k is
    # float32's choice, not the formula's: such near ties at the boundary are left out (on the
    # counted tokens only). Logits in [-4, 4] are 4.8e-7 apart at most per ulp and float32's
    # softmax rounds each probability by a few 1e-7 relative, so a gap of 1e-5 in the logits
    # (1e-5 relative in the probabilities) is decided by the formula. Exact ties are kept: both
    # sides give equal logits equal probabilities and take the lower index first.
    ranked = -np.sort(-np.asarray(logits, np.float64), axis=-1)[:, where]
    gap = ranked[..., top_k - 1] - ranked[..., top_k] if top_k < E else np.zeros(1)
    assume(np.all((gap == 0) | (gap > 1e-5)))
    kwargs = dict(top_k=top_k, pool_layers=pool, normalize_by_top_k=normalize)
    got = losses.load_balancing_loss(logits, where=where, **kwargs)
    assert got.shape == (() if pool else (L,))
    expected = balancing_reference(logits, top_k, where, pool, normalize)
    assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_balanced_routing_gives_k_or_one_and_collapse_gives_more():
    # Each token's top-2 are a different pair; together every expert is chosen equally often.
    eye = np.eye(E)
    logits = np.log(0.01 + eye + np.roll(eye, 1, axis=1))[None]  # [1, E tokens, E]
    for normalize, balanced in ((False, 2.0), (True, 1.0)):
        kwargs = dict(top_k=2, normalize_by_top_k=normalize)
        assert_close(losses.load_balancing_loss(logits, **kwargs), balanced, rtol=1e-5)
        collapsed = np.broadcast_to(logits[:, :1], logits.shape)
        assert float(losses.load_balancing_loss(collapsed, **kwargs)) > 2.5 * balanced
    # Pooled over identical layers equals each layer's own loss.
    stacked = np.concatenate([logits, logits])
    per_layer = losses.load_balancing_loss(stacked, top_k=2, pool_layers=False)
    assert_close(per_layer, [2.0, 2.0], rtol=1e-5)


def test_masked_tokens_are_left_out_and_no_token_gives_zero():
    logits = np.random.default_rng(0).normal(size=(L, B, T, E)).astype(np.float32)
    where = np.ones((B, T), bool)
    where[1, 3:] = False
    masked = losses.load_balancing_loss(logits, top_k=2, where=where)
    kept = np.concatenate([logits[:, 0], logits[:, 1, :3]], axis=1)
    assert_close(masked, losses.load_balancing_loss(kept, top_k=2), rtol=1e-6)
    nothing = np.zeros((B, T), bool)
    assert float(losses.load_balancing_loss(logits, top_k=2, where=nothing)) == 0.0
    grad = jax.grad(lambda z: losses.load_balancing_loss(z, top_k=2, where=nothing))(logits)
    assert np.all(np.asarray(grad) == 0)


def test_gradient_flows_through_the_probabilities_only():
    """d/dz of E sum_e f_e P_e with f held fixed: the fractions are counts, not differentiable."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(1, 4, E))
    with jax.enable_x64(True):
        grad = np.asarray(jax.grad(lambda z: losses.load_balancing_loss(z, top_k=2))(logits))
    p = softmax64(logits[0])
    counts = np.zeros(E)
    for row in p:
        counts[np.argsort(-row)[:2]] += 1
    f = counts / 4
    # P_e = mean_t p_te, so dL/dz_t = E/T * (J_softmax(z_t) @ f) = E/T * p_t * (f - p_t . f).
    expected = E / 4 * p * (f - (p @ f)[:, None])
    assert_close(grad[0], expected, rtol=1e-9, atol=1e-12)


def test_router_z_loss_reference_mask_and_gradient():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(L, B, T, E)).astype(np.float32) * 3
    where = rng.random((B, T)) < 0.7
    got = losses.router_z_loss(logits, where=where)
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    assert_close(got, np.where(where, lse**2, 0.0), rtol=1e-5)
    # Full-rank masks and suffix masks agree; masked entries give no gradient.
    full = np.broadcast_to(where, (L, B, T))
    assert_close(losses.router_z_loss(logits, where=full), got, rtol=0, atol=0)
    grad = np.asarray(jax.grad(lambda z: losses.router_z_loss(z, where=where).sum())(logits))
    assert np.all(grad[:, ~where] == 0)
    expected = 2 * lse[..., None] * softmax64(logits)
    assert_close(grad[:, where], expected[:, where], rtol=1e-4, atol=1e-5)
    # Adding c to every logit adds c to the log-partition: the loss grows for c > 0 here.
    shifted = np.asarray(losses.router_z_loss(logits + 5.0))
    assert np.all(shifted[:, where] > np.asarray(got)[:, where])


def test_bfloat16_logits_stay_close_to_float32():
    logits = np.random.default_rng(3).normal(size=(L, B, T, E)).astype(np.float32)
    low = jnp.asarray(logits, jnp.bfloat16)
    rounded = np.asarray(low, np.float32)
    assert losses.load_balancing_loss(low, top_k=2).dtype == jnp.float32
    assert_close(
        losses.load_balancing_loss(low, top_k=2),
        losses.load_balancing_loss(rounded, top_k=2),
        rtol=1e-6,
    )
    assert_close(losses.router_z_loss(low), losses.router_z_loss(rounded), rtol=1e-6)


def test_no_recompilation_and_errors():
    rng = np.random.default_rng(4)
    calls = [((rng.normal(size=(L, B, T, E)).astype(np.float32),), {}) for _ in range(2)]
    assert_traced_once(lambda z: losses.load_balancing_loss(z, top_k=2), calls)
    assert_traced_once(losses.router_z_loss, calls)
    logits = calls[0][0][0]
    with own_checks():
        with raises_naming("top_k", "[1, 6]"):
            losses.load_balancing_loss(logits, top_k=7)
        with raises_naming("router_logits", "[L, ..., E]"):
            losses.load_balancing_loss(logits[0, 0, 0], top_k=1)
        with raises_naming("where"):
            losses.load_balancing_loss(logits, top_k=2, where=np.ones((T, B), bool))
        with raises_naming("where", "trailing"):
            losses.router_z_loss(logits, where=np.ones((T,), bool)[:4])
        with raises_naming("router_logits", error=TypeError):
            losses.router_z_loss(np.ones((2, 3), np.int32))
