"""`quantize_params` / `dequantize_params`, and products with quantised weights in `peft.lora`.

A product with an `NF4Tensor` or `Int8Tensor` inside `peft.lora(f)` must equal `f` on the
dequantised parameters, its gradient with respect to the input must equal the dense one, and
the backward pass must keep the stored codes, not a dense float copy of the weight.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests._helpers import assert_close, assert_traced_once, own_checks, raises_naming
from tunelib import peft
from tunelib.peft import Int8Tensor, NF4Tensor, UnmatchedRuleWarning

IN, OUT, BATCH, LAYERS = 128, 96, 5, 3


@functools.partial(jax.jit, static_argnums=(1, 2))
def _quantize(params, format, double_quant):
    return peft.quantize_params(params, ["w"], format=format, double_quant=double_quant)


def quantize(params, *, format, double_quant=True):
    """`quantize_params` of the weight "w", compiled once per shapes and options."""
    return _quantize(params, format, double_quant)


dequantize = jax.jit(peft.dequantize_params)


def normal(seed, shape, scale=1.0):
    return scale * jax.random.normal(jax.random.key(seed), shape)


def kernel_params(seed=0):
    """One `[in, out]` kernel, the JAX convention."""
    return {"w": normal(seed, (IN, OUT), IN**-0.5)}


def stacked_params(seed=0):
    """`[layers, d, d]` kernels, for a `lax.scan` over layers."""
    return {"w": normal(seed, (LAYERS, IN, IN), IN**-0.5)}


FORMATS = pytest.mark.parametrize("format", ["nf4", "int8"])


def matmul(p, x):
    return x @ p["w"]


def einsum(p, x):
    return jnp.einsum("bi,io->bo", x, p["w"])


def transposed(p, y):  # y [B, out] @ W.T [out, in]
    return y @ p["w"].T


def weight_on_the_left(p, z):  # W [in, out] @ z [out, 3]
    return p["w"] @ z


def layers(p, x):
    def layer(h, w):
        return jnp.tanh(h @ w), None

    return jax.lax.scan(layer, x, p["w"])[0]


def input_for(fn, seed=1):
    shape = {transposed: (BATCH, OUT), weight_on_the_left: (OUT, 3)}.get(fn, (BATCH, IN))
    return normal(seed, shape)


def loss(fn):
    """A scalar with a non-constant cotangent: sum(sin(fn(p, x)))."""
    return lambda p, x: jnp.sum(jnp.sin(fn(p, x)))


@functools.partial(jax.jit, static_argnums=0)
def evaluate(fn, params, x):
    """`fn(params, x)`, and the value and input gradient of `sum(sin(fn(params, x)))`."""
    value, grad = jax.value_and_grad(loss(fn), argnums=1)(params, x)
    return fn(params, x), value, grad


def assert_same_results(ours, dense, *, rtol=1e-5, atol=1e-5):
    for a, e in zip(ours, dense, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype
        assert_close(a, e, rtol=rtol, atol=atol * max(1.0, float(jnp.abs(e).max())))


# ---- products inside peft.lora ---------------------------------------------------------------


# KNOWN BUG: [transposed-nf4] fails until fixed: `W.T` dispatches to `NF4Tensor.transpose`,
# whose `eqx.tree_at` on a static field raises (see tests/peft/test_nf4.py).
@FORMATS
@pytest.mark.parametrize("fn", [matmul, einsum, transposed, weight_on_the_left])
def test_products_equal_the_function_on_dequantised_params(format, fn):
    qparams = quantize(kernel_params(), format=format)
    dense = dequantize(qparams)
    x = input_for(fn)
    assert_same_results(evaluate(peft.lora(fn), qparams, x), evaluate(fn, dense, x))


@FORMATS
def test_dequantised_weights_are_close_to_the_originals(format):
    w = kernel_params()["w"]
    dense = dequantize(quantize(kernel_params(), format=format))["w"]
    assert dense.shape == w.shape and dense.dtype == w.dtype
    # NF4: within half the widest code gap (0.152) of the absmax; int8: half a step of 1/127.
    tol = (0.16 if format == "nf4" else 0.5 / 127 * 1.001) * float(jnp.abs(w).max())
    assert_close(dense, w, rtol=0, atol=tol)


@FORMATS
def test_stacked_weights_under_scan(format):
    qparams = quantize(stacked_params(), format=format)
    dense = dequantize(qparams)
    x = input_for(layers)
    ours, expected = evaluate(peft.lora(layers), qparams, x), evaluate(layers, dense, x)
    assert_same_results(ours, expected, rtol=1e-4, atol=1e-5)


@functools.partial(jax.jit, static_argnums=0)
def residuals(fn, params, x):
    """The arrays the backward pass of `loss(fn)` with respect to `x` keeps."""
    _, vjp_fn = jax.vjp(lambda x: loss(fn)(params, x), x)
    return jax.tree.leaves(vjp_fn)


def dense_float_residuals(fn, params, x, weight_size):
    return [
        (r.shape, r.dtype)
        for r in residuals(fn, params, x)
        if jnp.issubdtype(r.dtype, jnp.floating) and r.size >= weight_size
    ]


@FORMATS
def test_backward_keeps_the_codes_not_a_dense_weight(format):
    qparams = quantize(kernel_params(), format=format)
    x = input_for(matmul)
    # The check can fail: the plain function on dense params saves the [in, out] weight.
    dense = dequantize(qparams)
    assert dense_float_residuals(matmul, dense, x, IN * OUT) == [((IN, OUT), jnp.float32)]
    assert dense_float_residuals(peft.lora(matmul), qparams, x, IN * OUT) == []
    stored = {(r.shape, r.dtype) for r in residuals(peft.lora(matmul), qparams, x)}
    if format == "nf4":
        assert ((IN * OUT // 2,), np.dtype(np.uint8)) in stored  # the packed codes
    else:
        assert ((IN, OUT), np.dtype(np.int8)) in stored
    sq = quantize(stacked_params(), format=format)
    assert dense_float_residuals(peft.lora(layers), sq, x, IN * IN) == []


@FORMATS
def test_no_retrace_on_new_weights_and_inputs(format):
    fn = peft.lora(loss(matmul))
    assert_traced_once(
        lambda p, x: jax.value_and_grad(fn, argnums=1)(p, x),
        [
            ((quantize(kernel_params(seed), format=format), normal(seed + 10, (BATCH, IN))), {})
            for seed in range(3)
        ],
    )


def bf16_matmul(p, x):
    return x.astype(jnp.bfloat16) @ p["w"].astype(jnp.bfloat16)


# KNOWN BUG, fails until fixed (both formats): `.astype` dispatches to `with_dtype`, whose
# `eqx.tree_at` on the static field `value_dtype` raises (see tests/peft/test_nf4.py).
@FORMATS
def test_bf16_compute_dtype(format):
    qparams = quantize(kernel_params(), format=format)
    dense = dequantize(qparams)
    x = input_for(matmul)
    low, _, grad = evaluate(peft.lora(bf16_matmul), qparams, x)
    exact, _, exact_grad = evaluate(matmul, dense, x)
    assert low.dtype == jnp.bfloat16 and grad.dtype == jnp.float32
    # The float64 product of the bf16-rounded operands: only the output rounding is left.
    w16 = np.asarray(dense["w"].astype(jnp.bfloat16), np.float64)
    expected = np.asarray(x.astype(jnp.bfloat16), np.float64) @ w16
    scale = np.abs(expected).max()
    assert_close(low, expected, rtol=2**-7, atol=1e-3 * scale)
    assert_close(low, exact, rtol=0, atol=2e-2 * scale)
    assert_close(grad, exact_grad, rtol=0, atol=2e-2 * np.abs(exact_grad).max())


# ---- quantize_params / dequantize_params -----------------------------------------------------


def model_params():
    return {
        "layers": [
            {
                "q_proj": {"kernel": jnp.ones((8, 4)), "bias": jnp.zeros(4)},
                "o_proj": {"kernel": jnp.ones((4, 8))},
                "norm": {"scale": jnp.ones(8)},
            }
            for _ in range(2)
        ],
        "embed": {"embedding": jnp.ones((10, 8))},
        "step": jnp.zeros((3, 3), jnp.int32),
    }


def abstract(patterns, **kwargs):
    """What `quantize_params` returns, from shapes only."""
    return jax.eval_shape(lambda p: peft.quantize_params(p, patterns, **kwargs), model_params())


def test_patterns_fullmatch_slash_joined_paths():
    out = abstract([r"layers/\d+/q_proj/kernel"])
    for layer in out["layers"]:
        assert isinstance(layer["q_proj"]["kernel"], NF4Tensor)
        assert not isinstance(layer["o_proj"]["kernel"], NF4Tensor)
    assert not isinstance(out["embed"]["embedding"], NF4Tensor)
    out = abstract([r".*_proj/kernel", r"embed/.*"], format="int8")
    leaves = jax.tree_util.tree_leaves_with_path(
        out, is_leaf=lambda x: isinstance(x, NF4Tensor | Int8Tensor)
    )
    kinds = {
        jax.tree_util.keystr(path, simple=True, separator="/"): type(leaf).__name__
        for path, leaf in leaves
    }
    assert kinds == {
        "layers/0/q_proj/kernel": "Int8Tensor",
        "layers/0/q_proj/bias": "ShapeDtypeStruct",
        "layers/0/o_proj/kernel": "Int8Tensor",
        "layers/0/norm/scale": "ShapeDtypeStruct",
        "layers/1/q_proj/kernel": "Int8Tensor",
        "layers/1/q_proj/bias": "ShapeDtypeStruct",
        "layers/1/o_proj/kernel": "Int8Tensor",
        "layers/1/norm/scale": "ShapeDtypeStruct",
        "embed/embedding": "Int8Tensor",
        "step": "ShapeDtypeStruct",
    }
    # A substring of a path is not a match: the pattern must match the whole path.
    with raises_naming("'q_proj/kernel'", "selects nothing", error=ValueError):
        abstract(["q_proj/kernel"])


def test_untouched_leaves_are_the_same_objects_and_dequantize_params_inverts():
    params = model_params()
    params["layers"][0]["q_proj"]["kernel"] = normal(0, (8, 4))
    out = peft.quantize_params(params, [r"layers/0/q_proj/kernel"], format="int8")
    assert out["layers"][0]["q_proj"]["bias"] is params["layers"][0]["q_proj"]["bias"]
    assert out["layers"][1]["q_proj"]["kernel"] is params["layers"][1]["q_proj"]["kernel"]
    assert out["step"] is params["step"]
    q = out["layers"][0]["q_proj"]["kernel"]
    assert isinstance(q, Int8Tensor)
    back = peft.dequantize_params(out)
    expected = np.asarray(q.values, np.float32) * np.asarray(q.scale)  # one scale per column
    assert np.array_equal(back["layers"][0]["q_proj"]["kernel"], expected)
    assert back["embed"]["embedding"] is params["embed"]["embedding"]
    assert jax.tree.structure(back) == jax.tree.structure(params)


def test_layouts_and_options():
    nf4 = abstract([r"layers/0/q_proj/kernel"])["layers"][0]["q_proj"]["kernel"]
    assert nf4.transposed and nf4.stored_shape == (4, 8) and nf4.shape == (8, 4)
    assert nf4.double_quantized and nf4.absmax.dtype == jnp.uint8 and nf4.matmul == "xla"
    nf4 = abstract(
        [r"layers/0/q_proj/kernel"],
        layout="out_in",
        double_quant=False,
        block_size=16,
        matmul="pallas",
    )["layers"][0]["q_proj"]["kernel"]
    assert not nf4.transposed and nf4.stored_shape == (8, 4) and nf4.block_size == 16
    assert not nf4.double_quantized and nf4.absmax.dtype == jnp.float32
    assert nf4.absmax.shape == (2,) and nf4.matmul == "pallas"
    int8 = abstract([r"layers/0/q_proj/kernel"], format="int8")["layers"][0]["q_proj"]["kernel"]
    assert isinstance(int8, Int8Tensor) and int8.channel_axis == -1 and int8.scale.shape == (4,)
    int8 = abstract([r"layers/0/q_proj/kernel"], format="int8", layout="out_in")
    assert int8["layers"][0]["q_proj"]["kernel"].channel_axis == -2


def test_selection_errors_name_the_pattern_or_the_path():
    with raises_naming("'nothing/here'", "matches no parameter path", error=ValueError):
        abstract([r".*kernel", "nothing/here"])
    with raises_naming("'.*q_proj/.*'", "'layers/0/q_proj/bias'", error=ValueError):
        abstract([r".*q_proj/.*"])  # the 1-D bias
    with raises_naming("'step'", "int32", error=ValueError):
        abstract(["step"])
    with raises_naming("'.*/kernel'", "taken by an earlier one", error=ValueError):
        abstract([r".*_proj/kernel", r".*/kernel"])
    with own_checks():  # beartype would reject the Literal arguments first
        with raises_naming("format", "'nf8'", error=ValueError):
            abstract(["embed/embedding"], format="nf8")
        with raises_naming("layout", "'io'", error=ValueError):
            abstract(["embed/embedding"], layout="io")
    with raises_naming("'embed/embedding'", error=TypeError):
        abstract("embed/embedding")  # a string, not a sequence of patterns
    once = abstract(["embed/embedding"], format="int8")
    with raises_naming("'embed/embedding'", "already quantised", error=ValueError):
        jax.eval_shape(lambda p: peft.quantize_params(p, ["embed/.*"]), once)


def test_allow_unmatched_warns_and_quantises_the_rest():
    with pytest.warns(UnmatchedRuleWarning, match="nothing/here"):
        out = abstract(["nothing/here", "embed/embedding"], allow_unmatched=True)
    assert isinstance(out["embed"]["embedding"], NF4Tensor)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmatchedRuleWarning)
        with pytest.raises(UnmatchedRuleWarning):
            abstract(["nothing/here"], allow_unmatched=True)


def test_in_out_kernel_has_the_codes_of_bitsandbytes_on_the_hf_weight():
    pytest.importorskip("bitsandbytes")
    torch = pytest.importorskip("torch")
    import bitsandbytes.functional as F

    params = kernel_params()
    weight = np.ascontiguousarray(np.asarray(params["w"]).T)  # the Hugging Face [out, in]
    for double_quant in (False, True):
        q = quantize(params, format="nf4", double_quant=double_quant)["w"]
        packed, state = F.quantize_4bit(
            torch.from_numpy(weight),
            blocksize=64,
            compress_statistics=double_quant,
            quant_type="nf4",
        )
        assert q.stored_shape == (OUT, IN) and q.transposed
        assert np.array_equal(packed.numpy().reshape(-1), q.codes)
        if double_quant:
            # bitsandbytes' CPU 8-bit blockwise quantiser does not always round to nearest and
            # its dynamic map is up to 1 ulp off ours: most 8-bit absmax codes agree.
            assert np.mean(state.absmax.numpy() == np.asarray(q.absmax)) >= 0.99
            assert state.offset.item() == pytest.approx(float(q.absmax_offset), rel=1e-6)
        else:
            assert np.array_equal(state.absmax.numpy(), q.absmax)
            assert np.array_equal(F.dequantize_4bit(packed, state).numpy().T, q.dequantize())
