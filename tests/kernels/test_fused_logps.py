"""`fused_token_logps_pallas` against materialised references, in the Pallas interpreter.

Both lowerings' kernels (GPU/Triton style and TPU/Mosaic style) run on CPU with
`interpret=True`, with blocks that are valid on the real hardware. Shapes are tiny and fixed
per test (every new shape compiles the interpreted kernels again), chosen so that N, V and H are
not multiples of their blocks and span several of them. The kernels compiled on a GPU or TPU
are tested in `test_on_device.py` (the accelerator tier).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import assert_close, assert_traced_once, float_arrays, own_checks, raises_naming
from tunelib.kernels import _fused_logps, fused_token_logps_pallas

# Blocks legal on the hardware: powers of two >= 16 on GPU, multiples of (8, 128) on TPU.
BLOCKS = {
    "gpu": {"platform": "gpu", "block_n": 16, "block_v": 128, "block_h": 16},
    "tpu": {"platform": "tpu", "block_n": 8, "block_v": 128},
}
PLATFORMS = pytest.mark.parametrize("platform", sorted(BLOCKS))

kernel = jax.jit(
    fused_token_logps_pallas,
    static_argnames=(
        "with_entropy",
        "softcap",
        "block_n",
        "block_v",
        "block_h",
        "platform",
        "interpret",
    ),
)


def fused(*args, platform, **kwargs):
    return kernel(*args, interpret=True, **BLOCKS[platform], **kwargs)


# ---- references -------------------------------------------------------------------------------


def ref_logits(h, w, b, tau):
    h, w = np.asarray(h, np.float64), np.asarray(w, np.float64)
    b = 0.0 if b is None else np.asarray(b, np.float64)
    return (h @ w + b) / tau


def ref_forward(h, w, y, b=None, tau=1.0):
    """float64 log-softmax of the materialised logits, gathered; and the entropy."""
    z = ref_logits(h, w, b, tau)
    m = z.max(-1, keepdims=True)
    log_p = z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))
    logps = log_p[np.arange(len(z)), np.asarray(y)]
    return logps, -(np.exp(log_p) * log_p).sum(-1)


def ref_grads(h, w, y, b, tau, g, e):
    """Closed-form float64 gradients of sum(g * logps + e * entropy), from
    dz = g (onehot - p) - e p (z - E_p z), z = (h W + b) / tau."""
    z = ref_logits(h, w, b, tau)
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    onehot = np.eye(z.shape[1])[np.asarray(y)]
    g, e = np.asarray(g, np.float64)[:, None], np.asarray(e, np.float64)[:, None]
    dz = g * (onehot - p) - e * p * (z - (p * z).sum(-1, keepdims=True))
    du = dz / tau
    h, w = np.asarray(h, np.float64), np.asarray(w, np.float64)
    return du @ w.T, h.T @ du, du.sum(0), -(dz * z).sum() / tau


def naive_jax(h, w, y, b, tau):
    """Materialised logits, `log_softmax` and a gather: the path the kernels replace."""
    z = (h @ w + (0.0 if b is None else b)) / tau
    log_p = jax.nn.log_softmax(z, axis=-1)
    logps = jnp.take_along_axis(log_p, y[:, None], axis=-1)[:, 0]
    return logps, -jnp.sum(jnp.exp(log_p) * log_p, axis=-1)


def problem(n, size_h, vocab, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(n, size_h)).astype(dtype)
    w = (rng.normal(size=(size_h, vocab)) / np.sqrt(size_h) * 3).astype(dtype)
    b = rng.normal(size=(vocab,)).astype(dtype)
    y = rng.integers(0, vocab, n)
    return h, w, b, y


# ---- values and gradients ---------------------------------------------------------------------


@PLATFORMS
def test_values_and_gradients_match_references(platform):
    """In float64, where the kernel's blocks, the closed form and the materialised path agree
    to rounding: in float32 they sum in different orders, which used 0.13 of fixed tolerances
    on this CPU (logits of up to 30) and depends on the CPU."""
    with jax.enable_x64(True):
        # N = 21, V = 300, H = 40: several blocks along every axis, none a multiple of its block.
        h, w, b, y = problem(21, 40, 300, dtype=np.float64)
        rng = np.random.default_rng(1)
        g, e = rng.normal(size=21), rng.normal(size=21)
        where = np.ones(21, bool)
        where[[3, 10]] = False
        h_bad, y_bad = h.copy(), y.copy()
        h_bad[3], h_bad[10], y_bad[[3, 10]] = np.nan, np.inf, -100  # masked: anything goes
        tau = 0.7

        def total(h, w, b, tau):
            kwargs = {"bias": b, "temperature": tau, "with_entropy": True, "where": where}
            logps, entropy = fused(h, w, y_bad, platform=platform, **kwargs)
            return jnp.sum(g * logps + e * entropy), (logps, entropy)

        (_, (logps, entropy)), grads = jax.value_and_grad(
            total, argnums=(0, 1, 2, 3), has_aux=True
        )(h_bad, w, b, tau)
        keep = where
        ref_logps, ref_entropy = ref_forward(h[keep], w, y[keep], b, tau)
        assert logps.dtype == entropy.dtype == jnp.float64
        assert_close(logps[keep], ref_logps, rtol=1e-12, atol=1e-12)
        assert_close(entropy[keep], ref_entropy, rtol=1e-12, atol=1e-12)
        assert np.all(np.asarray(logps)[~keep] == 0) and np.all(np.asarray(entropy)[~keep] == 0)

        dh, dw, db, dtau = ref_grads(h[keep], w, y[keep], b, tau, g[keep], e[keep])
        assert_close(grads[0][keep], dh, rtol=1e-10, atol=1e-12)
        assert np.all(np.asarray(grads[0])[~keep] == 0)
        assert_close(grads[1], dw, rtol=1e-10, atol=1e-12)
        assert_close(grads[2], db, rtol=1e-10, atol=1e-12)
        assert_close(grads[3], dtau, rtol=1e-10)

        # The closed form above is itself the derivative of the materialised path.
        def naive_total(h, w, b, tau):
            logps, entropy = naive_jax(h, w, jnp.asarray(y[keep]), b, tau)
            return jnp.sum(g[keep] * logps + e[keep] * entropy)

        naive = jax.grad(naive_total, argnums=(0, 1, 2, 3))(h[keep], w, b, tau)
        for ours, theirs in zip((grads[0][keep], *grads[1:]), naive, strict=True):
            assert_close(ours, np.asarray(theirs), rtol=1e-10, atol=1e-12)


@PLATFORMS
def test_soft_capped_logits_match_the_chunked_head(platform):
    """`softcap` caps every tile's logits (and the target's) and scales the backward pass by
    the cap's slope: values and all four gradients equal the pure-JAX head's, which is itself
    tested against autodiff of the capped logits in float64."""
    from tunelib.logprobs import fused_token_logps

    h, w, b, y = problem(21, 40, 300, dtype=np.float64)
    h = h * 2  # logits well past the cap of 2
    weights = np.random.default_rng(1).normal(size=(2, 21))

    def total(head):
        def f(h, w, b, tau):
            logps, entropy = head(h, w, y, bias=b, temperature=tau, softcap=2.0, with_entropy=True)
            return jnp.sum(weights[0] * logps + weights[1] * entropy), (logps, entropy)

        return jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(h, w, b, np.float64(0.7))

    # In float64, where the two heads' orders of summation agree to rounding (in float32 they
    # used 0.14 of fixed tolerances on this CPU).
    with jax.enable_x64(True):
        (_, ours), ours_grads = total(lambda *a, **k: fused(*a, platform=platform, **k))
        (_, chunked), chunked_grads = total(
            lambda *a, **k: fused_token_logps(*a, implementation="chunked", chunk_size=64, **k)
        )
        uncapped = fused(h, w, y, bias=b, temperature=0.7, platform=platform)
    assert ours[0].dtype == jnp.float64
    for got, want in zip(ours, chunked, strict=True):
        assert_close(got, want, rtol=1e-12, atol=1e-12)
    for got, want in zip(ours_grads, chunked_grads, strict=True):
        assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert np.abs(np.asarray(uncapped) - np.asarray(ours[0])).max() > 0.1


@PLATFORMS
def test_log_probs_alone_without_bias(platform):
    """In float64: with logits of up to 60, float32 rounding of the two orders of summation
    used 0.33 of fixed tolerances on this CPU."""
    h, w, _, y = problem(5, 24, 130, seed=2, dtype=np.float64)

    def total(h, w):
        return jnp.sum(fused(h, w, y, platform=platform) ** 2)

    with jax.enable_x64(True):
        value, (dh, dw) = jax.value_and_grad(total, argnums=(0, 1))(h, w)
        empty = fused(h[:0], w, y[:0], platform=platform)
    assert value.dtype == jnp.float64
    ref_logps, _ = ref_forward(h, w, y)
    assert_close(value, np.sum(ref_logps**2), rtol=1e-12)
    ref_dh, ref_dw, _, _ = ref_grads(h, w, y, None, 1.0, 2 * ref_logps, np.zeros(5))
    assert_close(dh, ref_dh, rtol=1e-10, atol=1e-12)
    assert_close(dw, ref_dw, rtol=1e-10, atol=1e-12)
    assert empty.shape == (0,)


@st.composite
def generated(draw):
    """A fixed shape (one compilation), generated values: large logits, spread temperatures."""
    h = draw(float_arrays((6, 24), -3, 3))
    w = draw(float_arrays((24, 200), -3, 3))
    b = draw(float_arrays((200,), -30, 30))
    y = draw(float_arrays((6,), 0, 199)).astype(np.int32)
    return h, w, b, y, draw(st.floats(0.25, 4.0))


@PLATFORMS
@given(data=generated())
def test_matches_reference_on_generated_inputs(platform, data):
    h, w, b, y, tau = data
    logps, entropy = fused(h, w, y, bias=b, temperature=tau, with_entropy=True, platform=platform)
    assert logps.dtype == entropy.dtype == jnp.float32
    ref_logps, ref_entropy = ref_forward(h, w, y, b, tau)
    assert_close(logps, ref_logps, rtol=1e-5, atol=1e-3)
    assert_close(entropy, ref_entropy, rtol=1e-4, atol=1e-3)
    assert np.all(np.asarray(logps) <= 1e-6)
    assert np.all(np.asarray(entropy) >= -1e-5)
    assert np.all(np.asarray(entropy) <= np.log(200) + 1e-4)


@PLATFORMS
@given(data=st.data())
def test_every_target_forms_a_distribution(platform, data):
    # One hidden state repeated once per vocabulary id, so the rows ask for every target.
    vocab = 40
    h = np.repeat(data.draw(float_arrays((1, 8), -3, 3)), vocab, axis=0)
    w = data.draw(float_arrays((8, vocab), -3, 3))
    b = data.draw(float_arrays((vocab,), -5, 5))
    shift = data.draw(st.floats(-50, 50))
    y = np.arange(vocab)
    logps, entropy = fused(h, w, y, bias=b, with_entropy=True, platform=platform)
    assert_close(np.log(np.sum(np.exp(np.asarray(logps, np.float64)))), 0.0, atol=1e-5)
    assert_close(entropy, np.full(vocab, entropy[0]), atol=1e-6)
    # Adding a constant to every logit changes nothing.
    shifted = fused(h, w, y, bias=b + np.float32(shift), platform=platform)
    assert_close(shifted, logps, atol=1e-4)


# ---- masks ------------------------------------------------------------------------------------


@PLATFORMS
def test_masked_equals_sliced_and_fully_masked_is_zero(platform):
    h, w, b, y = problem(13, 24, 130, seed=3)
    where = np.arange(13) < 9
    masked = fused(h, w, y, bias=b, with_entropy=True, where=where, platform=platform)
    sliced = fused(h[:9], w, y[:9], bias=b, with_entropy=True, platform=platform)
    for full, part in zip(masked, sliced, strict=True):
        assert_close(full[:9], np.asarray(part), atol=1e-6)
        assert np.all(np.asarray(full[9:]) == 0)

    none = np.zeros(13, bool)
    h_nan = np.full_like(h, np.nan)

    def total(h, w, b):
        logps, entropy = fused(h, w, y, bias=b, with_entropy=True, where=none, platform=platform)
        return jnp.sum(logps) + jnp.sum(entropy)

    value, grads = jax.value_and_grad(total, argnums=(0, 1, 2))(h_nan, w, b)
    assert value == 0
    assert all(np.all(np.asarray(grad) == 0) for grad in grads)


def test_targets_outside_the_vocabulary():
    h, w, b, y = problem(13, 24, 130, seed=3)
    with raises_naming("targets", "130", "V = 130", error=ValueError):
        fused_token_logps_pallas(h, w, np.where(np.arange(13) == 4, 130, y), interpret=True)
    # Under jit (the shapes and blocks of the test above: nothing new compiles) a counted id
    # out of range gives a NaN log-prob and a masked one 0; the other tokens are unchanged.
    where = np.arange(13) < 9
    bad = np.where(np.arange(13) == 4, -3, np.where(np.arange(13) == 10, 500, y))
    logps, entropy = fused(h, w, bad, bias=b, with_entropy=True, where=where, platform="gpu")
    good, good_entropy = fused(h, w, y, bias=b, with_entropy=True, where=where, platform="gpu")
    assert np.isnan(logps[4]) and logps[10] == 0
    keep = np.arange(13) != 4
    np.testing.assert_array_equal(np.asarray(logps)[keep], np.asarray(good)[keep])
    np.testing.assert_array_equal(entropy, good_entropy)


# ---- dtypes -----------------------------------------------------------------------------------


@PLATFORMS
def test_bf16_inputs(platform):
    h, w, b, y = problem(13, 24, 130, seed=4)
    h16, w16 = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    logps, entropy = fused(h16, w16, y, bias=b, with_entropy=True, platform=platform)
    assert logps.dtype == entropy.dtype == jnp.float32
    # bf16 operands, float32 accumulation: exact up to float32 rounding for the rounded inputs...
    rounded = ref_forward(np.asarray(h16, np.float32), np.asarray(w16, np.float32), y, b)
    assert_close(logps, rounded[0], rtol=1e-5, atol=1e-4)
    assert_close(entropy, rounded[1], rtol=1e-5, atol=1e-4)
    # ...and within the rounding of the inputs (|logits| up to ~10 here) of float32.
    exact = ref_forward(h, w, y, b)
    assert_close(logps, exact[0], atol=0.1)
    assert_close(entropy, exact[1], atol=0.1)

    dh, dw = jax.grad(
        lambda h, w: jnp.sum(fused(h, w, y, bias=b, platform=platform)), argnums=(0, 1)
    )(h16, w16)
    assert dh.dtype == dw.dtype == jnp.bfloat16
    ref_dh, ref_dw, _, _ = ref_grads(h, w, y, b, 1.0, np.ones(13), np.zeros(13))
    # d z is rounded to bf16 before the backward matmuls: about 1% of the largest entry.
    assert_close(dh, ref_dh, atol=0.02 * np.abs(ref_dh).max())
    assert_close(dw, ref_dw, atol=0.02 * np.abs(ref_dw).max())


@PLATFORMS
def test_float64_stays_float64(platform):
    with jax.enable_x64(True):
        h, w, b, y = problem(13, 24, 130, seed=5, dtype=np.float64)
        kwargs = {"bias": b, "temperature": 1.3, "platform": platform}
        logps, entropy = fused(h, w, y, with_entropy=True, **kwargs)
        assert logps.dtype == entropy.dtype == jnp.float64
        ref_logps, ref_entropy = ref_forward(h, w, y, b, 1.3)
        assert_close(logps, ref_logps, rtol=1e-12, atol=1e-12)
        assert_close(entropy, ref_entropy, rtol=1e-12, atol=1e-12)
        dw = jax.grad(lambda w: jnp.sum(fused(h, w, y, **kwargs)))(w)
        assert dw.dtype == jnp.float64
        ref_dw = ref_grads(h, w, y, b, 1.3, np.ones(13), np.zeros(13))[1]
        assert_close(dw, ref_dw, rtol=1e-10, atol=1e-12)


# ---- transformations --------------------------------------------------------------------------


@PLATFORMS
def test_vmap_and_no_retrace(platform):
    h, w, b, y = problem(13, 24, 130, seed=6)
    hs, ys = np.stack([h, 2 * h]), np.stack([y, y[::-1]])
    one = jax.jit(lambda h, y: fused(h, w, y, bias=b, platform=platform))
    mapped = jax.vmap(one)(hs, ys)
    for k in range(2):
        assert_close(mapped[k], ref_forward(hs[k], w, ys[k], b)[0], rtol=1e-5, atol=1e-5)

    def call(h, w, y, temperature):
        return fused_token_logps_pallas(
            h, w, y, temperature=temperature, interpret=True, **BLOCKS[platform]
        )

    assert_traced_once(call, [((h, w, y, jnp.float32(t)), {}) for t in (0.5, 1.0, 2.0)])


@PLATFORMS
def test_no_n_by_v_buffer(platform):
    """Compiled values and gradients never hold [N, V] logits (even in the interpreter)."""
    n, size_h, vocab = 1024, 16, 4096
    h, w, y = jnp.zeros((n, size_h)), jnp.zeros((size_h, vocab)), jnp.zeros((n,), jnp.int32)
    blocks = {**BLOCKS[platform], "block_n": 64, "block_v": 512}

    def total(h, w):
        return jnp.sum(fused_token_logps_pallas(h, w, y, interpret=True, **blocks))

    compiled = jax.jit(jax.grad(total, argnums=(0, 1))).lower(h, w).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp < n * vocab * 4 / 8, temp
    naive = jax.jit(jax.grad(lambda h, w: jnp.sum(naive_jax(h, w, y, None, 1.0)[0]), (0, 1)))
    assert naive.lower(h, w).compile().memory_analysis().temp_size_in_bytes >= n * vocab * 4


# ---- blocks and errors ------------------------------------------------------------------------


def test_default_blocks_divide_the_unembedding():
    config = _fused_logps._config
    tpu = config(13, 40, 384, None, None, None, "tpu", False, True)
    assert (tpu.block_n, tpu.block_v, tpu.block_h) == (16, 384, 40)  # no wider than V
    assert config(1000, 40, 512, None, None, None, "tpu", False, True).block_n == 256
    assert config(1000, 40, 256_000, None, None, None, "tpu", False, True).block_v == 512
    # 32000 = 2^8 x 125: 512 does not divide it, 256 does.
    assert config(1000, 40, 32_000, None, None, None, "tpu", False, True).block_v == 256
    gpu = config(13, 96, 256_000, None, None, None, "gpu", False, True)
    assert (gpu.block_n, gpu.block_v, gpu.block_h) == (16, 128, 32)
    assert config(13, 40, 50_240, None, None, None, "gpu", False, True).block_v == 64
    # Neither 128 nor 64 divides 300: the preferred tile, and the unembedding is padded.
    assert config(13, 40, 300, None, None, None, "gpu", False, True).block_v == 128


def test_errors_name_the_argument():
    h, w, y = jnp.zeros((4, 8)), jnp.zeros((8, 130)), jnp.zeros((4,), jnp.int32)
    with raises_naming("hidden"):
        fused_token_logps_pallas(jnp.zeros((4, 8), int), w, y, interpret=True)
    with raises_naming("targets"):
        fused_token_logps_pallas(h, w, jnp.zeros((5,), jnp.int32), interpret=True)
    with own_checks():
        with raises_naming("hidden", "(2, 4, 8)", error=ValueError):
            fused_token_logps_pallas(jnp.zeros((2, 4, 8)), w, y, interpret=True)
        with raises_naming("unembedding", "(9, 130)", error=ValueError):
            fused_token_logps_pallas(h, jnp.zeros((9, 130)), y, interpret=True)
        with raises_naming("targets", "(5,)", "(4,)", error=ValueError):
            fused_token_logps_pallas(h, w, jnp.zeros((5,), jnp.int32), interpret=True)
        with raises_naming("targets", error=TypeError):
            fused_token_logps_pallas(h, w, jnp.zeros((4,)), interpret=True)
        with raises_naming("bias", "(129,)", error=ValueError):
            fused_token_logps_pallas(h, w, y, bias=jnp.zeros(129), interpret=True)
        with raises_naming("where", error=TypeError):
            fused_token_logps_pallas(h, w, y, where=jnp.ones(4), interpret=True)
        with raises_naming("temperature", error=ValueError):
            fused_token_logps_pallas(h, w, y, temperature=0.0, interpret=True)
        with raises_naming("block_v", "128", error=ValueError):
            fused_token_logps_pallas(h, w, y, platform="tpu", block_v=64, interpret=True)
        with raises_naming("block_n", "power of two", error=ValueError):
            fused_token_logps_pallas(h, w, y, platform="gpu", block_n=24, interpret=True)
        with raises_naming("block_h", error=ValueError):
            fused_token_logps_pallas(h, w, y, platform="tpu", block_h=16, interpret=True)
        with raises_naming("platform", error=ValueError):
            fused_token_logps_pallas(h, w, y, platform="cpu", interpret=True)
        if jax.default_backend() == "cpu":
            with raises_naming("interpret", error=ValueError):
                fused_token_logps_pallas(h, w, y)
