"""The decoder's dense projection in float32 on CPU: its product summed over blocks of input
features (`tunelib.models._layers.Dense`), the plain products as its derivatives, and
`tunelib.peft`'s own product for adapted weights.

The tiny decoders of the other tests are 64 wide, one block; these layers are SmolLM2's."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tunelib import peft
from tunelib._products import unblocked_products
from tunelib.models import DecoderConfig
from tunelib.models._layers import Dense, _block_count, _matmul
from tunelib.models._per_layer import PerLayer

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="blocks only on CPU")

CONFIG = DecoderConfig(
    vocab_size=32, hidden_size=576, intermediate_size=1536, num_hidden_layers=1,
    num_attention_heads=9, num_key_value_heads=3, head_dim=64,
)  # fmt: skip
EPS = np.finfo(np.float32).eps


def normal(seed: int, *shape: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def test_block_count():
    """Equal blocks of 96 to 192 features; one block when there is no such division."""
    counts = {k: _block_count(k) for k in (64, 192, 193, 576, 896, 1536, 2048, 4864, 389)}
    assert counts == {64: 1, 192: 1, 193: 1, 576: 3, 896: 7, 1536: 8, 2048: 16, 4864: 32,
                      389: 1}  # fmt: skip


@pytest.mark.parametrize("features", [576, 1536])
def test_value_is_the_sum_of_its_blocks(features):
    """`Dense` gives its blocks' partial products added pairwise (each partial to float32
    rounding of its own width), and is closer to the float64 product than the plain one."""
    layer = Dense(features, 96, ("embed", "mlp"), CONFIG, use_bias=False, rngs=nnx.Rngs(0))
    x = normal(1, 2, 40, features)
    y = np.asarray(nnx.jit(lambda layer, x: layer(x))(layer, x))
    x, w = np.asarray(x), np.asarray(layer.kernel[...])
    blocks = _block_count(features)
    width = features // blocks
    parts = [x[..., i * width : (i + 1) * width] @ w[i * width : (i + 1) * width]
             for i in range(blocks)]  # fmt: skip
    while len(parts) > 1:
        pairs = [a + b for a, b in zip(parts[::2], parts[1::2], strict=False)]
        parts = pairs + parts[len(pairs) * 2 :]
    scale = np.abs(x) @ np.abs(w)
    assert np.all(np.abs(y - parts[0]) <= 2 * width * EPS * scale)
    exact = x.astype(np.float64) @ w.astype(np.float64)
    plain = np.asarray(jax.jit(jnp.matmul)(x, w))
    assert np.sqrt(np.mean((y - exact) ** 2)) < np.sqrt(np.mean((plain - exact) ** 2))


def test_unblocked_products_are_one_dot_each():
    """Inside `unblocked_products()` (the sampler's `products="plain"`) `Dense` traces one dot,
    bit for bit XLA's plain product, and the blocked one again outside it; the per-layer
    layout's products likewise."""
    layer = Dense(576, 96, ("embed", "mlp"), CONFIG, use_bias=False, rngs=nnx.Rngs(0))
    x = normal(1, 2, 40, 576)
    run = lambda: np.asarray(jax.jit(lambda x: layer(x))(x))  # noqa: E731  traced anew
    with unblocked_products():
        unblocked = run()
    blocked = run()
    plain = np.asarray(jax.jit(jnp.matmul)(x, layer.kernel[...]))
    np.testing.assert_array_equal(unblocked, plain)
    assert not np.array_equal(blocked, plain)  # the blocks round otherwise
    stacked = jnp.stack([layer.kernel[...], 2 * layer.kernel[...]])
    at = lambda i: PerLayer.unstack(stacked).at(jnp.int32(i))  # noqa: E731
    with unblocked_products():
        per_layer = np.asarray(jax.jit(lambda x: _matmul(x, at(0)))(x))
    np.testing.assert_array_equal(per_layer, plain)


def test_derivatives_are_the_plain_products():
    """`grad` gives `g @ W.T` and `x.T @ g`; `jvp` gives `dx @ W + x @ dW`."""
    x, w, g = normal(1, 2, 8, 576), normal(2, 576, 96), normal(3, 2, 8, 96)
    dx, dw = normal(4, *x.shape), normal(5, *w.shape)
    grad_x, grad_w = jax.jit(jax.grad(lambda x, w: jnp.sum(_matmul(x, w) * g), (0, 1)))(x, w)
    x, w, g, dx, dw = map(np.asarray, (x, w, g, dx, dw))
    np.testing.assert_allclose(grad_x, g @ w.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(grad_w, np.einsum("btk,btn->kn", x, g), rtol=1e-5, atol=1e-4)
    args = tuple(map(jnp.asarray, (x, w, dx, dw)))
    value, tangent = jax.jit(lambda *a: jax.jvp(_matmul, a[:2], a[2:]))(*args)
    np.testing.assert_array_equal(value, jax.jit(_matmul)(*args[:2]))
    np.testing.assert_allclose(tangent, dx @ w + x @ dw, rtol=1e-5, atol=1e-3)
    # A tangent of the input alone (a frozen kernel).
    _, tangent = jax.jvp(lambda x: _matmul(x, args[1]), args[:1], args[2:3])
    np.testing.assert_allclose(tangent, dx @ w, rtol=1e-5, atol=1e-3)


def test_an_adapted_kernel_keeps_its_own_product():
    """A LoRA kernel under `peft.lora` is not cut into blocks, which would form `W + s A B`:
    it is `x W + s (x A) B`."""
    layer = Dense(576, 96, ("embed", "mlp"), CONFIG, use_bias=False, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(layer)
    params = nnx.to_pure_dict(state)
    a, b = normal(6, 576, 4), normal(7, 4, 96)
    adapted = peft.apply_lora(params, {"kernel": peft.LoraAdapter(a=a, b=b, alpha=4.0)})
    x = normal(1, 2, 8, 576)

    def forward(params, x):
        return nnx.merge(graphdef, params)(x)

    with warnings.catch_warnings():
        warnings.simplefilter("error", peft.MaterializationWarning)
        out = peft.lora(forward)(adapted, x)
    x, w, a, b = map(np.asarray, (x, params["kernel"], a, b))
    np.testing.assert_allclose(out, x @ w + (x @ a) @ b, rtol=1e-4, atol=1e-3)  # s = 4 / 4
