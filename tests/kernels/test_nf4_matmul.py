"""`nf4_matmul_pallas` against a float64 NumPy reference, in the Pallas interpreter.

The interpreter is slow and compiles again for every shape, so the shapes are tiny and few:
M and N are not multiples of the blocks, and K spans two, four or (in
`test_no_retrace_on_new_values`) one quantisation block.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests._helpers import assert_close, own_checks, raises_naming
from tunelib import peft
from tunelib.kernels import nf4_matmul_pallas
from tunelib.peft import NF4_VALUES

TABLE = tuple(NF4_VALUES.tolist())

kernel = jax.jit(
    functools.partial(nf4_matmul_pallas, table=TABLE, interpret=True),
    static_argnames=("block_size", "block_m", "block_n", "out_dtype"),
)


def weight(n, k, seed=0, block_size=64):
    """Random packed NF4 codes `[n, k / 2]` and float32 absmax `[n, k / block_size]`, one block of
    each row all zeros (absmax 0)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 256, (n, k // 2)).astype(np.uint8)
    absmax = rng.uniform(0.1, 3.0, (n, k // block_size)).astype(np.float32)
    absmax[0, 0] = 0.0
    return codes, absmax


def ref_weight(codes, absmax, block_size=64) -> np.ndarray:
    """The float64 `[n, k]` weight: element 2j in the high nibble of byte j, times the block's
    absmax."""
    codes = np.asarray(codes)
    n = codes.shape[0]
    unpacked = np.stack([codes >> 4, codes & 15], axis=-1).reshape(n, -1)
    values = NF4_VALUES.astype(np.float64)[unpacked]
    return values * np.repeat(np.asarray(absmax, np.float64), block_size, axis=1)


def activations(m, k, seed=1, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), (m, k), dtype)


def rounding_bound(a, b, terms: int):
    """Float32's rounding of `a @ b`, summed in any order (the order a CPU's vector width or
    a kernel's tiles choose): at most gamma |a| @ |b| elementwise, gamma = (terms + 2) u with
    u = 2^-24, for `terms` products, each rounded once, and terms - 1 additions, plus one
    rounding of each operand before (Higham, Accuracy and Stability of Numerical Algorithms,
    section 3.1: |fl(x . y) - x . y| <= gamma_n |x| . |y|)."""
    gamma = (terms + 2) * 2.0**-24
    return gamma * (np.abs(np.asarray(a, np.float64)) @ np.abs(np.asarray(b, np.float64)))


@pytest.mark.parametrize(
    ("m", "n", "k", "blocks"),
    [
        (5, 70, 128, {}),  # default blocks (32, 64): M and N padded, N spans two tiles
        (20, 40, 256, {"block_m": 16, "block_n": 16}),  # several tiles along M and N
    ],
)
def test_float32_matches_the_float64_reference(m, n, k, blocks):
    codes, absmax = weight(n, k)
    x = activations(m, k)
    y = kernel(x, codes, absmax, **blocks)
    assert y.shape == (m, n) and y.dtype == jnp.float32
    expected = np.asarray(x, np.float64) @ ref_weight(codes, absmax).T
    assert_close(y, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_bf16_inputs():
    codes, absmax = weight(70, 128)
    x = activations(5, 128, dtype=jnp.bfloat16)
    y = kernel(x, codes, absmax)
    assert y.dtype == jnp.bfloat16
    # The kernel decodes the weight in float32, rounds it to x's dtype and accumulates in
    # float32: against the float64 product of the rounded operands only the output rounding
    # (2^-8 relative) is left.
    w16 = ref_weight(codes, absmax).astype(np.float32).astype(ml_dtypes.bfloat16)
    expected = np.asarray(x, np.float64) @ w16.astype(np.float64).T
    scale = np.abs(expected).max()
    assert_close(y, expected, rtol=2**-8, atol=1e-3 * scale)


def test_through_peft_equals_the_xla_product_and_the_dense_gradient():
    # x @ W for a kernel W [in, out], stored [out, in] = [70, 128]: two row blocks of 64, so
    # the backward kernel loops over two N tiles.
    w = 0.1 * jax.random.normal(jax.random.key(3), (128, 70))
    x = activations(5, 128)
    g = jax.random.normal(jax.random.key(2), (5, 70))

    def f(params, x):
        return x @ params["w"]

    def loss(params, x):
        return jnp.sum(g * jnp.sin(peft.lora(f)(params, x)))

    xla, pallas = jax.jit(
        lambda p: [peft.quantize_params(p, ["w"], matmul=m) for m in ("xla", "pallas")]
    )({"w": w})
    assert pallas["w"].matmul == "pallas" and xla["w"].matmul == "xla"
    run = jax.jit(jax.value_and_grad(loss, argnums=1))
    (value, grad), (xla_value, xla_grad) = run(pallas, x), run(xla, x)
    codes = np.asarray(pallas["w"].codes).reshape(70, 64)
    absmax = np.asarray(pallas["w"].block_absmax()).reshape(70, 2)
    w64 = ref_weight(codes, absmax)  # [70, 128]
    # The products sum in different orders, so the paths differ by float32 rounding, bounded
    # (for any order) by rounding_bound: y = x W^T within e_y; the value sum(g sin y) within
    # |g| . e_y plus its own sum's; the gradient (g cos y) W within (|g| e_y) |W| plus its
    # own product's. Each path is within the bound of the exact value: twice it apart.
    g64 = np.abs(np.asarray(g, np.float64))
    e_y = rounding_bound(x, w64.T, 128)
    e_value = np.sum(g64 * e_y) + rounding_bound(g64.reshape(1, -1), np.ones((350, 1)), 350)
    e_grad = (g64 * e_y) @ np.abs(w64) + rounding_bound(g64, w64, 70)
    assert np.abs(float(value) - float(xla_value)) <= 2 * e_value.item()
    assert np.all(np.abs(np.asarray(grad, np.float64) - np.asarray(xla_grad)) <= 2 * e_grad)
    # Against jax.grad of the dense float32 product with the weight decoded in NumPy.
    dense_w = jnp.asarray(w64, jnp.float32)
    dense_grad = jax.grad(lambda x: jnp.sum(g * jnp.sin(x @ dense_w.T)))(x)
    assert grad.shape == x.shape and grad.dtype == jnp.float32
    assert np.all(np.abs(np.asarray(grad, np.float64) - np.asarray(dense_grad)) <= 2 * e_grad)
    # The product really ran in the kernel (and only with matmul="pallas").
    assert "nf4_matmul_forward" in str(jax.make_jaxpr(peft.lora(f))(pallas, x))
    assert "nf4_matmul" not in str(jax.make_jaxpr(peft.lora(f))(xla, x))


def test_rows_that_are_not_whole_blocks_fall_back_to_xla():
    # A kernel [96, 70] is stored [70, 96]: rows of 96 are not whole blocks of 64.
    w = 0.1 * jax.random.normal(jax.random.key(4), (96, 70))
    quantized = jax.jit(lambda p: peft.quantize_params(p, ["w"], matmul="pallas"))({"w": w})
    x = activations(5, 96)

    def f(p, x):
        return x @ p["w"]

    assert "nf4_matmul" not in str(jax.make_jaxpr(peft.lora(f))(quantized, x))
    dense = jax.jit(peft.dequantize_params)(quantized)["w"]
    expected = np.asarray(x, np.float64) @ np.asarray(dense, np.float64)
    assert_close(jax.jit(peft.lora(f))(quantized, x), expected, rtol=1e-5, atol=1e-5)


def test_no_retrace_on_new_values():
    # K = 64: one quantisation block per row.
    traced = jax.jit(
        chex.assert_max_traces(
            lambda x, codes, absmax: nf4_matmul_pallas(
                x, codes, absmax, table=TABLE, interpret=True
            ),
            n=1,
        )
    )
    for seed in range(2):
        codes, absmax = weight(20, 64, seed=seed)
        x = activations(3, 64, seed=seed)
        w = ref_weight(codes, absmax)
        error = np.abs(np.asarray(traced(x, codes, absmax), np.float64) - np.asarray(x) @ w.T)
        assert np.all(error <= rounding_bound(x, w.T, 64))  # float32's, in any order
    chex.clear_trace_counter()


def test_shape_errors():
    codes, absmax = weight(20, 128)
    x = activations(3, 128)
    with raises_naming("block_size", "K = 96", error=ValueError):
        nf4_matmul_pallas(x[:, :96], codes[:, :48], absmax[:, :1], table=TABLE)
    with raises_naming("block_size", error=ValueError):
        nf4_matmul_pallas(x, codes, absmax, table=TABLE, block_size=63)
    with raises_naming("codes", "(20, 64)", "(20, 32)", error=ValueError):
        nf4_matmul_pallas(x, codes[:, :32], absmax, table=TABLE)
    with raises_naming("absmax", "(20, 2)", "(20, 1)", error=ValueError):
        nf4_matmul_pallas(x, codes, absmax[:, :1], table=TABLE)
    with raises_naming("table", "15", error=ValueError):
        nf4_matmul_pallas(x, codes, absmax, table=TABLE[:15])
    with own_checks():
        with raises_naming("2-D", error=ValueError):
            nf4_matmul_pallas(x[None], codes, absmax, table=TABLE)
        with raises_naming("codes", "int32", error=TypeError):
            nf4_matmul_pallas(x, codes.astype(np.int32), absmax, table=TABLE)


def test_on_a_tpu_the_kernel_is_refused_in_one_line(monkeypatch):
    """It has no Mosaic lowering: compiled on a TPU it would fail deep inside the lowering."""
    codes, absmax = weight(20, 128)
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with raises_naming("Triton (GPU) lowering only", "matmul='xla'", error=ValueError):
        nf4_matmul_pallas(activations(3, 128), codes, absmax, table=TABLE)
