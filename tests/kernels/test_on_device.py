"""The Pallas kernels compiled for the accelerator (Mosaic on a TPU, Triton on a GPU), against
float64 NumPy references computed on the host, and the pure-JAX paths beside them.

Part of the accelerator tier (docs/tpu.md): skipped where JAX has no GPU or TPU. Every
tolerance is a bound from `tests._precision`, derived from the operands for the precision each
computation multiplies at: the kernels' float32 products at full precision, the pure-JAX paths
at JAX's default (one bfloat16 pass on a TPU). Each result is held to the float64 reference
within its own bound, which bounds the distance between any two of them as well.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests._accelerator import backend, interpreted, kernel_options
from tests._precision import assert_within, fused_head, matmul_error
from tunelib.kernels import fused_token_logps_pallas, nf4_matmul_pallas
from tunelib.logprobs import fused_token_logps
from tunelib.peft import NF4_VALUES

pytestmark = pytest.mark.accelerator

# Neither N nor V a multiple of the default blocks (on a TPU 256 x 512, on a GPU 64 x 128).
N, H, V = 1000, 256, 5000
TEMPERATURE = 0.8
DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}


def problem(dtype, seed=0):
    """Hidden states, unembedding (as the device holds them), bias, targets and the cotangents
    of the log-probs and the entropy; logits of up to about 20."""
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(N, H)).astype(dtype)
    w = (rng.normal(size=(H, V)) / np.sqrt(H) * 3).astype(dtype)
    b = rng.normal(size=V).astype(np.float32)
    y = rng.integers(0, V, N)
    g, e = rng.normal(size=(2, N)).astype(np.float32)
    return h, w, b, y, g, e


def values_and_gradients(head, h, w, g, e):
    """`(logps, entropy), (d h, d w)` of `sum(g logps + e entropy)` on the default device."""

    def total(h, w):
        logps, entropy = head(h, w)
        return jnp.sum(g * logps + e * entropy), (logps, entropy)

    (_, values), grads = jax.jit(jax.value_and_grad(total, argnums=(0, 1), has_aux=True))(h, w)
    return values, grads


def capped_logps(h, w, b, y, temperature, softcap):
    """float64 log-probs of the targets at `temperature`."""
    u = np.asarray(h, np.float64) @ np.asarray(w, np.float64) + b
    z = (u if softcap is None else softcap * np.tanh(u / softcap)) / temperature
    m = z.max(-1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(z - m).sum(-1))
    return z[np.arange(len(z)), y] - lse


@pytest.mark.parametrize("softcap", [None, 10.0], ids=["uncapped", "softcap"])
@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_fused_head_kernel_against_float64_and_the_pure_jax_paths(dtype, softcap):
    """Log-probs, entropy, d hidden and d unembedding of the kernel (default blocks, compiled)
    and of the chunked and naive paths, each within its bound of the float64 reference: the
    kernel multiplies float32 at full precision and 16-bit inputs as they are, and casts the
    logits' cotangent to the inputs' dtype for the backward products; the pure-JAX paths
    multiply at JAX's default precision with a float32 cotangent."""
    h, w, b, y, g, e = problem(DTYPES[dtype])
    options = {"bias": b, "temperature": TEMPERATURE, "softcap": softcap, "with_entropy": True}
    heads = {
        "pallas": lambda h, w: fused_token_logps_pallas(h, w, y, **options, **kernel_options()),
        "chunked": lambda h, w: fused_token_logps(h, w, y, **options, implementation="chunked"),
        "naive": lambda h, w: fused_token_logps(h, w, y, **options, implementation="naive"),
    }
    precision = {"pallas": "highest", "chunked": None, "naive": None}
    cotangent = {"pallas": h.dtype, "chunked": np.float32, "naive": h.dtype}
    reference = {}
    for name, head in heads.items():
        (logps, entropy), (dh, dw) = values_and_gradients(head, h, w, g, e)
        assert logps.dtype == entropy.dtype == jnp.float32
        assert dh.dtype == h.dtype and dw.dtype == w.dtype
        ref = fused_head(
            h, w, b, y, temperature=TEMPERATURE, softcap=softcap, g=g, e=e,
            precision=precision[name], cotangent_dtype=cotangent[name],
        )  # fmt: skip
        assert_within(logps, ref.logps, ref.logps_error, what=f"{name} logps")
        assert_within(entropy, ref.entropy, ref.entropy_error, what=f"{name} entropy")
        assert_within(dh, ref.dh, ref.dh_error, what=f"{name} d hidden")
        assert_within(dw, ref.dw, ref.dw_error, what=f"{name} d unembedding")
        reference[name] = ref
    # The bounds are tight enough to see a mistake: most tokens' log-probs at temperature 1
    # (a temperature ignored) lie outside them.
    ignored = capped_logps(h, w, b, y, 1.0, softcap)
    ref = reference["pallas"]
    assert np.mean(np.abs(ignored - ref.logps) > ref.logps_error) > 0.5
    if softcap is not None:  # and the cap binds
        assert np.abs(capped_logps(h, w, b, y, TEMPERATURE, None) - ref.logps).max() > 1.0


def test_fused_head_kernel_holds_no_n_by_v_buffer():
    """Compiled values and gradients at N = 8192, V = 32000 keep gradients and O(N) numbers,
    not `[N, V]` logits."""
    n, size_h, vocab = 8192, 512, 32_000
    h = jnp.zeros((n, size_h), jnp.bfloat16)
    w = jnp.zeros((size_h, vocab), jnp.bfloat16)
    y = jnp.zeros((n,), jnp.int32)

    def total(h, w):
        return jnp.sum(fused_token_logps_pallas(h, w, y, **kernel_options()))

    compiled = jax.jit(jax.grad(total, argnums=(0, 1))).lower(h, w).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < n * vocab * 4 / 8


# ---- NF4 dequantise-and-multiply --------------------------------------------------------------

TABLE = tuple(NF4_VALUES.tolist())
BLOCK = 64


def nf4_weight(n, k, seed=0):
    """Random packed codes `[n, k / 2]`, float32 block absmax `[n, k / 64]` and the float32
    weight `[n, k]` they encode: each element one product of a code value and its block's
    absmax, correctly rounded on every IEEE backend, so the kernel's weight tile equals it."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (n, k // 2)).astype(np.uint8)
    absmax = rng.uniform(0.1, 3.0, (n, k // BLOCK)).astype(np.float32)
    unpacked = np.stack([codes >> 4, codes & 15], axis=-1).reshape(n, k)
    weight = NF4_VALUES.astype(np.float32)[unpacked] * np.repeat(absmax, BLOCK, axis=1)
    return codes, absmax, weight


def pure_jax_nf4(x, codes, absmax):
    """The reference the kernel replaces: decode the weight in XLA, then `x @ W^T`."""
    unpacked = jnp.stack([codes >> 4, codes & 15], axis=-1).reshape(codes.shape[0], -1)
    weight = jnp.asarray(NF4_VALUES)[unpacked.astype(jnp.int32)]
    weight = weight * jnp.repeat(absmax, BLOCK, axis=1)
    return jnp.matmul(x, weight.astype(x.dtype).T, preferred_element_type=jnp.float32).astype(
        x.dtype
    )


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_nf4_kernel_against_float64_and_the_pure_jax_product(dtype):
    """`nf4_matmul_pallas` (compiled; M and N not multiples of its blocks, K eight
    quantisation blocks) and its input gradient against the float64 product with the weight
    it encodes, and the pure-JAX product beside it, each within its bound: the kernel rounds
    the weight tile to the activations' dtype and multiplies float32 at full precision, the
    pure-JAX product at JAX's default. The kernel has a Triton lowering only: on a TPU it is
    refused in one line, and the pure-JAX product is checked alone."""
    m, n, k = 100, 300, 512
    codes, absmax, weight = nf4_weight(n, k)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(m, k)).astype(DTYPES[dtype])
    g = rng.normal(size=(m, n)).astype(np.float32)

    def kernel(x):
        return nf4_matmul_pallas(x, codes, absmax, table=TABLE, interpret=interpreted())

    def value_and_input_grad(product):
        def total(x):
            y = product(x)
            return jnp.sum(g * y.astype(jnp.float32)), y

        (_, y), dx = jax.jit(jax.value_and_grad(total, has_aux=True))(x)
        return y, dx

    weight64 = weight.astype(np.float64)
    y_exact = x.astype(np.float64) @ weight64.T
    dx_exact = g.astype(np.float64) @ weight64
    # The weight as multiplied: float32, or rounded to the activations' 16-bit dtype.
    stored = DTYPES[dtype] if dtype != "float32" else None
    products = [("kernel", kernel, "highest"), ("pure JAX", None, None)]
    if backend() == "tpu" and not interpreted():
        with pytest.raises(ValueError, match=r"Triton \(GPU\) lowering only"):
            kernel(x)
        products = products[1:]
    for name, product, precision in products:
        product = product or (lambda x: pure_jax_nf4(x, codes, absmax))
        y, dx = value_and_input_grad(product)
        assert y.dtype == dx.dtype == x.dtype and y.shape == (m, n)
        y_bound = matmul_error(x, weight.T, precision=precision, b_stored=stored, out_dtype=x.dtype)
        # The cotangent is rounded to x's dtype before the backward product.
        dx_bound = matmul_error(
            g, weight, precision=precision, a_stored=x.dtype, b_stored=stored, out_dtype=x.dtype
        )
        assert_within(y, y_exact, y_bound, what=f"{name} product")
        assert_within(dx, dx_exact, dx_bound, what=f"{name} input gradient")
    # The bounds are tight enough to see a mistake: with each row's absmax taken from the
    # next block along the row, most products lie outside them.
    shifted = np.repeat(np.roll(absmax, 1, axis=1), BLOCK, axis=1) / np.repeat(absmax, BLOCK, 1)
    wrong = x.astype(np.float64) @ (weight64 * shifted).T
    assert np.mean(np.abs(wrong - y_exact) > y_bound) > 0.5
