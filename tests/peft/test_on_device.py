"""LoRA products on the accelerator, over a float base, an NF4 base (QLoRA) and GGUF blocks,
against the same computation on the host's CPU and a float64 reference.

Part of the accelerator tier (docs/tpu.md): skipped where JAX has no GPU or TPU.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests._accelerator import backend, host
from tests._precision import U32, assert_within, matmul_error
from tests.peft.test_nf4 import ref_dequantize
from tunelib import peft
from tunelib.peft import GGML_TYPES

pytestmark = pytest.mark.accelerator

M, K, N, RANK, ALPHA = 64, 256, 192, 8, 16.0  # K: 4 NF4 blocks, 8 GGUF blocks per row
BASES = ("float32", "nf4", *GGML_TYPES)


def ggml_exact(t: peft.GGMLTensor) -> np.ndarray:
    """The float64 array a GGML tensor's blocks encode: d q, d (q - 8) or d q + m."""
    d = np.asarray(t.scales, np.float64)[..., None]
    codes = np.asarray(t.codes)
    if t.type_name == "Q8_0":
        values = codes.astype(np.float64) * d
    else:
        q = np.concatenate([codes & 15, codes >> 4], axis=-1).astype(np.float64)
        values = d * (q - 8) if t.type_name == "Q4_0" else d * q + np.asarray(t.mins)[..., None]
    stored = values.reshape(*values.shape[:-2], -1)
    return stored.T if t.transposed else stored


def base_weight(kind: str, kernel: np.ndarray):
    """The base weight `[K, N]` (float or quantised), the float64 array it encodes, and a bound
    on the error of a float32 dequantisation of it: NF4 rounds the double-quantised absmax
    (M[q] s + o, two roundings) and its product with the code value; Q4_1 rounds d q + m; the
    other products of a float16 scale and a small code are exact in float32."""
    if kind == "float32":
        return kernel, kernel.astype(np.float64), np.zeros(kernel.shape)
    if kind == "nf4":
        q = jax.jit(lambda w: peft.quantize_params({"w": w}, ["w"]))(kernel)["w"]
        exact = ref_dequantize(q)
        offset = np.abs(np.asarray(q.absmax_offset, np.float64))
        return q, exact, U32 * (3 * np.abs(exact) + offset)
    t = peft.ggml_quantize(kernel, kind, transpose=True)
    exact = ggml_exact(t)
    return t, exact, U32 * np.abs(exact)


def products(params, x, g):
    """`y = lora(x @ W)` and the input gradient of `sum(g y)` (through the base's custom VJP)."""

    def forward(x):
        return peft.lora(lambda p, x: x @ p["w"])(params, x)

    y, pullback = jax.vjp(forward, x)
    return y, pullback(g)[0]


def lora_bounds(x, g, w, w_error, a, b, *, on: str):
    """Bounds on `y = x W + s (x A) B` and `dx = g W^T + s (g B^T) A^T` computed in float32
    on backend `on` at JAX's default precision: each product's rounding, the dequantisation
    error carried through |x| (|g|), the inner product's error carried through the outer
    factor, and the scaling by s and the sum."""
    s = ALPHA / RANK
    x64, g64, a64, b64 = (np.asarray(t, np.float64) for t in (x, g, a, b))

    def low_rank(left, first, second):
        inner = left @ first
        inner_error = matmul_error(left, first, backend=on)
        outer = matmul_error(inner, second, backend=on, a_stored="float32")
        magnitude = (np.abs(left) @ np.abs(first)) @ np.abs(second)
        return s * (outer + inner_error @ np.abs(second)) + 2 * U32 * s * magnitude

    y = x64 @ w + s * (x64 @ a64) @ b64
    y_error = matmul_error(x64, w, backend=on) + np.abs(x64) @ w_error
    y_error += low_rank(x64, a64, b64) + U32 * np.abs(y)
    dx = g64 @ w.T + s * (g64 @ b64.T) @ a64.T
    dx_error = matmul_error(g64, w.T, backend=on) + np.abs(g64) @ w_error.T
    dx_error += low_rank(g64, b64.T, a64.T) + U32 * np.abs(dx)
    return (y, y_error), (dx, dx_error)


@pytest.mark.parametrize("kind", BASES)
def test_lora_products_on_the_accelerator_equal_the_host(kind):
    """The dequantised base on the accelerator within its bound of the float64 array its
    blocks encode; `lora(x @ W)` and its input gradient on the accelerator and on the host,
    each within its backend's bound of the float64 reference (so within the sum of both of
    each other); and the low-rank term large enough that dropping it would not pass."""
    rng = np.random.default_rng(0)
    kernel = (rng.normal(size=(K, N)) / np.sqrt(K)).astype(np.float32)
    a = (0.1 * rng.normal(size=(K, RANK))).astype(np.float32)
    b = (0.1 * rng.normal(size=(RANK, N))).astype(np.float32)
    x = rng.normal(size=(M, K)).astype(np.float32)
    g = rng.normal(size=(M, N)).astype(np.float32)
    base, exact, w_error = base_weight(kind, kernel)
    params = peft.apply_lora({"w": base}, {"w": peft.LoraAdapter(a=a, b=b, alpha=ALPHA)})
    run = jax.jit(products)

    accelerator = jax.devices()[0]
    if kind != "float32":
        on_device = jax.device_put(base, accelerator)
        dequantized = jax.jit(lambda t: t.dequantize())(on_device)
        assert dequantized.dtype == jnp.float32
        assert_within(dequantized, exact, w_error, what=f"{kind} dequantised on the device")
    results = {}
    for name, device, on in [("device", accelerator, backend()), ("host", host(), "cpu")]:
        y, dx = run(*jax.device_put((params, x, g), device))
        assert y.dtype == dx.dtype == jnp.float32
        assert y.devices() == {device}
        (y_exact, y_error), (dx_exact, dx_error) = lora_bounds(x, g, exact, w_error, a, b, on=on)
        assert_within(y, y_exact, y_error, what=f"{kind} forward on the {name}")
        assert_within(dx, dx_exact, dx_error, what=f"{kind} input gradient on the {name}")
        results[name] = (y, y_error)
    # The adapters count: the base alone is outside the device's bound for most entries.
    base_only = x.astype(np.float64) @ exact
    assert np.mean(np.abs(base_only - y_exact) > results["device"][1]) > 0.5
