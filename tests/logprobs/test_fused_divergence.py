"""The fused divergence head (tunelib/logprobs/_fused_divergence.py) against `token_divergence`
and float64 references."""

import functools

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
from tests.logprobs.test_token import ref_log_softmax
from tunelib import logprobs

DIVERGENCES = logprobs.DIVERGENCES
STATIC = ("divergence", "normalize", "chunk_size")
fused_divergence = jax.jit(logprobs.fused_divergence, static_argnames=STATIC)

# --- float64 NumPy references, written from the papers' formulas -----------------------------


def ref_kl(log_p, log_q):
    """KL(p || q) = sum_v p_v (log p_v - log q_v), with 0 log 0 = 0."""
    p = np.exp(log_p)
    safe = p > 0
    terms = p * (np.where(safe, log_p, 0.0) - np.where(safe, log_q, 0.0))
    return np.where(safe, terms, 0.0).sum(-1)


def ref_loss(z_s, z_t, divergence, beta=0.5, tau=1.0, normalize=True):
    """Hinton's KL(p_T || p_S), MiniLLM's KL(p_S || p_T), or GKD's JSD_beta."""
    log_ps, log_pt = ref_log_softmax(z_s, tau), ref_log_softmax(z_t, tau)
    if divergence == "forward_kl" or (divergence == "jsd" and normalize and beta == 0):
        return ref_kl(log_pt, log_ps)
    if divergence == "reverse_kl" or (divergence == "jsd" and normalize and beta == 1):
        return ref_kl(log_ps, log_pt)
    with np.errstate(divide="ignore"):
        log_m = np.log(beta * np.exp(log_pt) + (1 - beta) * np.exp(log_ps))
    jsd = beta * ref_kl(log_pt, log_m) + (1 - beta) * ref_kl(log_ps, log_m)
    return jsd / (beta * (1 - beta)) if normalize else jsd


def ref_logit_grad(z_s, z_t, divergence, beta=0.5, tau=1.0, normalize=True):
    """d loss / d z_S in closed form: p_S * (g - sum_v p_S g) / tau, with g = d loss / d p_S.

    Forward KL: g = -p_T / p_S, so the result is (p_S - p_T) / tau. Reverse KL: g = log p_S -
    log p_T (+ 1, which cancels). JSD_beta: g = (1 - beta) (log p_S - log M), the terms from
    d M / d p_S cancelling, divided by beta (1 - beta) when normalised.
    """
    log_ps, log_pt = ref_log_softmax(z_s, tau), ref_log_softmax(z_t, tau)
    ps, pt = np.exp(log_ps), np.exp(log_pt)
    if divergence == "forward_kl" or (divergence == "jsd" and normalize and beta == 0):
        return (ps - pt) / tau
    if divergence == "reverse_kl" or (divergence == "jsd" and normalize and beta == 1):
        g = log_ps - log_pt
    else:
        g = (1 - beta) * (log_ps - np.log(beta * pt + (1 - beta) * ps))
        g = g / (beta * (1 - beta)) if normalize else g
    return ps * (g - (ps * g).sum(-1, keepdims=True)) / tau


def heads(seed, n=3, h_s=4, h_t=3, v=7, scale=1.0):
    """Random float32 hidden states, unembeddings and biases for a student and a teacher."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return (scale * rng.normal(size=shape)).astype(np.float32)

    return normal(n, h_s), normal(h_s, v), normal(v), normal(n, h_t), normal(h_t, v), normal(v)


def logits(h, w, b):
    return np.asarray(h, np.float64) @ np.asarray(w, np.float64) + np.asarray(b, np.float64)


# --- values and gradients of both paths under one jit, compiled once per shape ---------------


@functools.partial(jax.jit, static_argnames=("divergence", "chunk_size", "normalize"))
def both_paths(
    h_s, w_s, b_s, h_t, w_t, b_t, tau, beta, cotangent, *, divergence, chunk_size, normalize=True
):
    """(values, student gradients) of the fused divergence and of `token_divergence`."""
    options = {"divergence": divergence, "mix": beta, "normalize": normalize, "temperature": tau}

    def fused(h_s, w_s, b_s):
        return logprobs.fused_divergence(
            h_s, w_s, h_t, w_t, student_bias=b_s, teacher_bias=b_t, chunk_size=chunk_size,
            **options,
        )  # fmt: skip

    def materialised(h_s, w_s, b_s):
        return logprobs.token_divergence(h_s @ w_s + b_s, h_t @ w_t + b_t, **options)

    out = []
    for f in (fused, materialised):
        value, pullback = jax.vjp(f, h_s, w_s, b_s)
        out.append((value, pullback(cotangent)))
    return out


# `normalize`, one compilation each: it only changes the JSD.
FLAG_SETS = {"forward_kl": [True], "reverse_kl": [True], "jsd": [True, False]}


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_fixed_values_and_gradients(divergence):
    h_s, w_s, b_s, h_t, w_t, b_t = heads(0, scale=1.5)
    z_s, z_t = logits(h_s, w_s, b_s), logits(h_t, w_t, b_t)
    cotangent = np.array([1.0, -0.5, 2.0], np.float32)
    betas = (0.0, 0.3, 1.0) if divergence == "jsd" else (0.5,)
    for normalize in FLAG_SETS[divergence]:
        for beta in betas:
            for tau in (1.0, 2.5, 0.7):
                (value, grads), (mat_value, mat_grads) = both_paths(
                    h_s, w_s, b_s, h_t, w_t, b_t, np.float32(tau), np.float32(beta), cotangent,
                    divergence=divergence, chunk_size=3, normalize=normalize,
                )  # fmt: skip
                options = (divergence, float(np.float32(beta)), tau, normalize)
                assert_close(value, ref_loss(z_s, z_t, *options), rtol=1e-5, atol=1e-6)
                assert_close(value, mat_value, rtol=1e-5, atol=1e-6)
                dz = cotangent[:, None] * ref_logit_grad(z_s, z_t, *options)
                refs = (
                    dz @ np.asarray(w_s, np.float64).T,
                    h_s.T.astype(np.float64) @ dz,
                    dz.sum(0),
                )
                for grad, mat_grad, ref in zip(grads, mat_grads, refs, strict=True):
                    assert_close(grad, ref, rtol=1e-4, atol=1e-5)
                    assert_close(grad, mat_grad, rtol=1e-4, atol=1e-5)


@st.composite
def problems(draw):
    # The shapes of `test_fixed_values_and_gradients` (V = 7 is no multiple of the tile 3),
    # so that `both_paths` compiles nothing new for a tile of 3.
    shapes = [(3, 4), (4, 7), (7,), (3, 3), (3, 7), (7,)]
    return [draw(float_arrays(shape, -3, 3)) for shape in shapes]


# Both ends, and betas the float64 reference (which divides by beta (1 - beta)) gets right;
# tiny betas are compared with `token_divergence` in `test_odd_vocabulary_any_chunk`.
betas = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.01, 0.99))


@given(
    problems(),
    st.sampled_from(DIVERGENCES),
    betas,
    st.floats(0.3, 3.0),
    st.data(),
)
def test_matches_materialised_and_reference(arrays, divergence, beta, tau, data):
    """In float64, where the tiled head, `token_divergence` and the reference, which sum in
    different orders, agree to rounding. In float32 generated logits of up to 40 at a
    temperature of 0.3 leave errors of a few 1e-5 in losses of 16 (0.27 of the tolerances
    this test had on this CPU), by how much depending on the CPU."""
    cotangent = data.draw(float_arrays((3,), -2, 2))
    with jax.enable_x64(True):
        (value, grads), (mat_value, mat_grads) = both_paths(
            *(np.asarray(x, np.float64) for x in arrays), np.float64(tau), np.float64(beta),
            np.asarray(cotangent, np.float64), divergence=divergence, chunk_size=3,
            normalize=True,
        )  # fmt: skip
    assert value.dtype == jnp.float64
    assert np.all(np.asarray(value) >= 0)
    z_s, z_t = logits(*arrays[:3]), logits(*arrays[3:])
    expected = ref_loss(z_s, z_t, divergence, beta, tau)
    assert_close(value, expected, rtol=1e-9, atol=1e-12)
    assert_close(value, mat_value, rtol=1e-10, atol=1e-12)
    for grad, mat_grad in zip(grads, mat_grads, strict=True):
        assert_close(grad, mat_grad, rtol=1e-9, atol=1e-12 * max(1.0, np.abs(mat_grad).max()))


@functools.partial(jax.jit, static_argnames="divergence")
def self_distillation(h, w, b, shift, beta, *, divergence):
    """A head's loss against itself, its gradient, and against itself plus a constant."""
    same, grad = jax.value_and_grad(
        lambda h_s: logprobs.fused_divergence(
            h_s, w, h, w, divergence=divergence, mix=beta, student_bias=b, teacher_bias=b,
            chunk_size=3,
        ).sum()
    )(h)  # fmt: skip
    h_t = jnp.concatenate([h, jnp.ones_like(h[:, :1])], axis=-1)
    w_t = jnp.concatenate([w, shift[None]], axis=0)  # z_T = z_S + shift
    shifted = logprobs.fused_divergence(
        h, w, h_t, w_t, divergence=divergence, mix=beta, chunk_size=3
    )
    return same, grad, shifted


@given(
    st.tuples(float_arrays((2, 3), -3, 3), float_arrays((3, 7), -3, 3), float_arrays((7,), -3, 3)),
    st.sampled_from(DIVERGENCES),
    st.floats(-20, 20),
    st.floats(0.0, 1.0),
)
def test_properties(head, divergence, shift, beta):
    h, w, b = head
    shift = np.full((7,), shift, np.float32)
    same, grad, shifted = self_distillation(h, w, b, shift, np.float32(beta), divergence=divergence)
    # A head distilled into itself has loss and gradient exactly 0.
    assert np.all(np.asarray(same) == 0) and np.all(np.asarray(grad) == 0)
    # A constant added to every teacher logit (a constant extra feature) changes nothing.
    assert_close(shifted, 0.0, atol=1e-5)


def test_odd_vocabulary_any_chunk():
    h_s, w_s, b_s, h_t, w_t, b_t = heads(1, n=4, v=13, scale=2.0)
    z_s, z_t = logits(h_s, w_s, b_s), logits(h_t, w_t, b_t)
    materialised = jax.jit(
        lambda z_s, z_t: logprobs.token_divergence(
            z_s, z_t, divergence="jsd", mix=1e-6, temperature=1.3
        )
    )((h_s @ w_s + b_s)[None], (h_t @ w_t + b_t)[None])[0]
    # One column per tile; a last tile shifted left over its neighbour (13 = 5 + 5 + 3); one tile.
    for chunk_size in (1, 5, 4096):
        out = fused_divergence(
            h_s, w_s, h_t, w_t, divergence="jsd", mix=np.float32(0.3),
            temperature=np.float32(1.3), student_bias=b_s, teacher_bias=b_t,
            chunk_size=chunk_size,
        )  # fmt: skip
        assert_close(out, ref_loss(z_s, z_t, "jsd", 0.3, 1.3), rtol=1e-5, atol=1e-6)
        # Near beta = 0 both paths keep float32 precision where the plain formula cannot.
        tiny = fused_divergence(
            h_s, w_s, h_t, w_t, divergence="jsd", mix=np.float32(1e-6),
            temperature=np.float32(1.3), student_bias=b_s, teacher_bias=b_t,
            chunk_size=chunk_size,
        )  # fmt: skip
        assert_close(tiny, materialised, rtol=1e-5, atol=1e-6)


def test_forbidden_tokens_in_both_biases():
    h_s, w_s, b_s, h_t, w_t, b_t = heads(2, v=6)
    b_s[[1, 4]] = b_t[[1, 4]] = -np.inf
    z_s, z_t = logits(h_s, w_s, b_s), logits(h_t, w_t, b_t)
    value, grads = jax.jit(
        jax.value_and_grad(
            lambda h, w, b: logprobs.fused_divergence(
                h, w, h_t, w_t, divergence="jsd", student_bias=b, teacher_bias=b_t, chunk_size=4
            ).sum(),
            argnums=(0, 1, 2),
        )
    )(h_s, w_s, b_s)
    assert_close(value, ref_loss(z_s, z_t, "jsd").sum(), rtol=1e-5)
    assert all(np.all(np.isfinite(g)) for g in grads)
    # No mass, no gradient: the forbidden columns of the unembedding and bias stay put.
    assert np.all(np.asarray(grads[1])[:, [1, 4]] == 0) and np.all(
        np.asarray(grads[2])[[1, 4]] == 0
    )


@jax.jit
def jsd_values_and_grads(h_s, w_s, b_s, h_t, w_t, b_t, where):
    """The masked JSD and its gradients for the student and the teacher hidden states."""

    def loss(h_s, w_s, b_s, h_t):
        return logprobs.fused_divergence(
            h_s, w_s, h_t, w_t, divergence="jsd", mix=0.3, temperature=2.0,
            student_bias=b_s, teacher_bias=b_t, where=where, chunk_size=3,
        )  # fmt: skip

    value, pullback = jax.vjp(loss, h_s, w_s, b_s, h_t)
    return value, pullback(jnp.ones_like(value))


def test_masks_with_nan_hidden_states():
    h_s, w_s, b_s, h_t, w_t, b_t = heads(3, n=8)
    h_s, h_t = h_s.reshape(2, 4, -1), h_t.reshape(2, 4, -1)
    where = np.array([[True, True, False, False], [True, True, True, False]])
    everything = np.ones_like(where)
    # Each token's loss depends on its own row only, so unmasked is the same as sliced.
    clean, clean_grads = jsd_values_and_grads(h_s, w_s, b_s, h_t, w_t, b_t, everything)
    h_s[~where], h_t[~where] = np.nan, np.nan
    out, grads = jsd_values_and_grads(h_s, w_s, b_s, h_t, w_t, b_t, where)
    assert_close(np.asarray(out)[where], np.asarray(clean)[where], rtol=1e-6, atol=1e-7)
    assert np.all(np.asarray(out)[~where] == 0)
    assert all(np.all(np.isfinite(g)) for g in grads)
    assert_close(np.asarray(grads[0])[where], np.asarray(clean_grads[0])[where], rtol=1e-5)
    assert np.all(np.asarray(grads[0])[~where] == 0)
    assert np.any(np.asarray(grads[1]) != 0)
    # The teacher is data: no gradient reaches it.
    assert np.all(np.asarray(grads[3]) == 0) and np.all(np.asarray(clean_grads[3]) == 0)
    # An integer 0/1 mask counts like the boolean one.
    integer, _ = jsd_values_and_grads(h_s, w_s, b_s, h_t, w_t, b_t, where.astype(np.int32))
    np.testing.assert_array_equal(integer, out)
    nothing, nothing_grads = jsd_values_and_grads(h_s, w_s, b_s, h_t, w_t, b_t, ~everything)
    assert np.all(np.asarray(nothing) == 0)
    assert all(np.all(np.asarray(g) == 0) for g in nothing_grads)


def test_bf16_inputs():
    # The shapes of `test_masks_with_nan_hidden_states`: the float32 calls compile nothing new.
    h_s, w_s, b_s, h_t, w_t, b_t = heads(4, n=8, scale=2.0)
    h_s, h_t = h_s.reshape(2, 4, -1), h_t.reshape(2, 4, -1)
    where = np.ones((2, 4), bool)
    bf16 = [jnp.asarray(x, jnp.bfloat16) for x in (h_s, w_s, b_s, h_t, w_t, b_t)]
    rounded = [np.asarray(x, np.float32) for x in bf16]
    low, low_grads = jsd_values_and_grads(*bf16, where)
    exact, exact_grads = jsd_values_and_grads(*rounded, where)
    full, _ = jsd_values_and_grads(h_s, w_s, b_s, h_t, w_t, b_t, where)
    assert low.dtype == jnp.float32
    # Matmuls accumulate in float32: the same as float32 on the rounded inputs.
    assert_close(low, exact, rtol=1e-5, atol=1e-6)
    # bf16 rounding (2^-8 relative) of logits of size ~5 moves the losses by < 0.02.
    assert_close(low, full, rtol=0.02, atol=0.02)
    # Gradients are accumulated in float32 and rounded once to bf16 (2^-8 relative).
    for grad, ref in zip(low_grads[:3], exact_grads[:3], strict=True):
        assert grad.dtype == jnp.bfloat16
        assert_close(grad, ref, rtol=1e-2, atol=1e-4)


def test_float64_stays_float64():
    with jax.enable_x64(True):
        h_s, w_s, b_s, h_t, w_t, b_t = (x.astype(np.float64) for x in heads(5, scale=2.0))
        z_s, z_t = logits(h_s, w_s, b_s), logits(h_t, w_t, b_t)
        out, grad = jax.jit(
            jax.value_and_grad(
                lambda w: logprobs.fused_divergence(
                    h_s, w, h_t, w_t, divergence="jsd", mix=0.2, temperature=1.5,
                    student_bias=b_s, teacher_bias=b_t, chunk_size=3,
                ).sum()
            )
        )(w_s)  # fmt: skip
        assert out.dtype == grad.dtype == jnp.float64
        assert_close(out, ref_loss(z_s, z_t, "jsd", 0.2, 1.5).sum(), rtol=1e-12)
        dz = ref_logit_grad(z_s, z_t, "jsd", 0.2, 1.5)
        assert_close(grad, h_s.T @ dz, rtol=1e-10, atol=1e-12)


def test_jit_vmap_and_no_retrace():
    h_s, w_s, _, h_t, w_t, _ = heads(6, n=6)
    h_s, h_t = h_s.reshape(2, 3, -1), h_t.reshape(2, 3, -1)
    where = np.array([[True, False, True], [True, True, False]])
    loss = functools.partial(logprobs.fused_divergence, divergence="jsd", chunk_size=4)
    # Mapped over the leading axis: the same as the [2, 3] call.
    mapped = jax.jit(
        jax.vmap(lambda a, b, m: loss(a, w_s, b, w_t, mix=0.3, temperature=1.5, where=m))
    )(h_s, h_t, where)
    ref = ref_loss(logits(h_s, w_s, 0), logits(h_t, w_t, 0), "jsd", 0.3, 1.5)
    assert_close(mapped, np.where(where, ref, 0.0), rtol=1e-5, atol=1e-6)
    calls = [
        ((h, w_s, h_t, w_t), {"mix": jnp.float32(b), "temperature": jnp.float32(t), "where": m})
        for h, b, t, m in (
            (h_s, 0.0, 0.5, where),
            (h_s, 0.3, 2.0, ~where),
            (h_t[..., :1].repeat(4, -1), 1.0, 1.0, where),
        )
    ]
    assert_traced_once(lambda *a, **k: jax.grad(lambda h: loss(h, *a[1:], **k).sum())(a[0]), calls)


def test_temporary_memory_is_a_few_tiles():
    divergence = "jsd"  # the largest temporaries of the three
    n, h, chunk = 512, 64, 1024

    def fused(h_s, w_s, h_t, w_t):
        return logprobs.fused_divergence(
            h_s, w_s, h_t, w_t, divergence=divergence, chunk_size=chunk
        ).sum()

    def materialised(h_s, w_s, h_t, w_t):
        return logprobs.token_divergence(
            h_s @ w_s, jax.lax.stop_gradient(h_t @ w_t), divergence=divergence
        ).sum()

    def temp_mib(f, v, with_grad=True):
        specs = [jax.ShapeDtypeStruct(s, jnp.float32) for s in [(n, h), (h, v)] * 2]
        f = jax.value_and_grad(f, argnums=(0, 1)) if with_grad else f
        return jax.jit(f).lower(*specs).compile().memory_analysis().temp_size_in_bytes / 2**20

    fused_grad, naive_grad = temp_mib(fused, 8192), temp_mib(materialised, 8192)
    # Measured on XLA CPU (jax 0.10.2), value and gradients: 39 MiB fused (about 20 tiles of
    # [512, 1024] float32, 2 MiB each) against 216 MiB materialised (forward KL: 18.5 / 132).
    assert fused_grad * 4 < naive_grad
    # The value alone (4.3 MiB measured) holds far less than one [N, V] float32 array (16 MiB).
    assert temp_mib(fused, 8192, with_grad=False) * 3 < n * 8192 * 4 / 2**20
    # Twice the vocabulary, the same temporaries (the [H, V] gradient is an output).
    assert temp_mib(fused, 16384) == fused_grad


def test_errors_name_the_argument():
    h_s, w_s, b_s, h_t, w_t, b_t = heads(7)
    with raises_naming("student_hidden"):
        logprobs.fused_divergence(h_s.astype(int), w_s, h_t, w_t)
    with raises_naming("teacher_hidden"):
        logprobs.fused_divergence(h_s, w_s, h_t[:2], w_t)
    with raises_naming("where"):
        logprobs.fused_divergence(h_s, w_s, h_t, w_t, where=np.ones(3, np.float32))
    with own_checks():
        with raises_naming("student_hidden", error=TypeError):
            logprobs.fused_divergence(h_s.astype(int), w_s, h_t, w_t)
        with raises_naming("teacher_unembedding", error=TypeError):
            logprobs.fused_divergence(h_s, w_s, h_t, w_t.astype(np.int32))
        with raises_naming("student_unembedding", "H = 4", "(3, 7)", error=ValueError):
            logprobs.fused_divergence(h_s, w_s[:3], h_t, w_t)
        with raises_naming("teacher_unembedding", "(3, 6)", "(3, 7)", error=ValueError):
            logprobs.fused_divergence(h_s, w_s, h_t, w_t[:, :6])
        with raises_naming("teacher_hidden", "(2, 3)", "(3, 3)", error=ValueError):
            logprobs.fused_divergence(h_s, w_s, h_t[:2], w_t)
        with raises_naming("student_bias", "(6,)", "(7,)", error=ValueError):
            logprobs.fused_divergence(h_s, w_s, h_t, w_t, student_bias=b_s[:6])
        with raises_naming("teacher_bias", error=TypeError):
            logprobs.fused_divergence(h_s, w_s, h_t, w_t, teacher_bias=b_t.astype(int))
        with raises_naming("where", "(2,)", error=ValueError):
            logprobs.fused_divergence(h_s, w_s, h_t, w_t, where=np.ones(2, bool))
        with raises_naming("divergence", "'kl'", error=ValueError):
            logprobs.fused_divergence(h_s, w_s, h_t, w_t, divergence="kl")
        with raises_naming("mix", error=ValueError):
            logprobs.fused_divergence(h_s, w_s, h_t, w_t, divergence="jsd", mix=1.5)
        with raises_naming("temperature", error=ValueError):
            logprobs.fused_divergence(h_s, w_s, h_t, w_t, temperature=0.0)
        with raises_naming("chunk_size", error=ValueError):
            logprobs.fused_divergence(h_s, w_s, h_t, w_t, chunk_size=0)
