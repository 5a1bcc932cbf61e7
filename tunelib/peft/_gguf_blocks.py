r"""llama.cpp's quantised blocks (GGUF Q8_0, Q4_0, Q4_1) kept as frozen base weights.

A GGUF file stores each row of a weight (a Hugging Face `[out, in]` matrix) as blocks of 32
consecutive elements, each with a float16 scale $d$ (and for Q4_1 a float16 minimum $m$):

| type | bytes per block | element $i$ of a block, from its code $q_i$ |
|---|---|---|
| Q8_0 | 2 + 32 | $x_i = d\,q_i$, $q_i$ int8 |
| Q4_0 | 2 + 16 | $x_i = d\,(q_i - 8)$, $q_i \in [0, 15]$ |
| Q4_1 | 2 + 2 + 16 | $x_i = d\,q_i + m$, $q_i \in [0, 15]$ |

The 4-bit codes of a block share 16 bytes: byte $j$ holds $q_j$ in its low nibble and
$q_{j+16}$ in its high nibble (ggml's `block_q4_0` / `block_q4_1`). `GGMLTensor` holds these
blocks as arrays and stands for the float array, as `NF4Tensor` does for NF4.
"""

import dataclasses
import functools
import os
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import quax
from flax import nnx
from jax.typing import ArrayLike, DTypeLike
from jaxtyping import Array, Float

from tunelib.formats import (
    GGUFModel,
    HFCheckpoint,
    LoadOptions,
    config_from_hf,
    gguf_raw_tensors,
    read_gguf,
)
from tunelib.models import (
    PROJECTION_KERNELS,
    Decoder,
    hf_module_name,
    param_shardings,
)
from tunelib.peft._rules import match_rules, path_string

GGML_TYPES: tuple[str, ...] = ("Q8_0", "Q4_0", "Q4_1")
GGML_BLOCK_SIZE = 32
# Bytes of one block in a file: the float16 scale, the float16 minimum (Q4_1), the codes.
_BLOCK_BYTES = {"Q8_0": 2 + 32, "Q4_0": 2 + 16, "Q4_1": 2 + 2 + 16}
_FLOAT_TYPES = ("F32", "F16", "BF16")


class GGMLTensor(quax.ArrayValue):
    r"""A matrix (or a stack of matrices) stored as GGML quantised blocks: Q8_0, Q4_0, Q4_1.

    It stands in for the array it quantises, as `NF4Tensor` does: inside a function wrapped
    by `tunelib.peft.lora` a matrix product with it dequantises the weight per call under a
    custom VJP that keeps only the blocks for the backward pass, and an embedding lookup
    dequantises only the rows it takes. `dequantize()` gives the array; in float32 it equals
    `gguf.quants.dequantize` of the same blocks bit for bit.

    The stored matrix of each leading index is `stored_shape` `[m, n]`: `m` rows of `n / 32`
    blocks, the layout of a GGUF file (a Hugging Face `[out, in]` weight). With `transposed`
    it stands for the transpose `[n, m]`, a JAX kernel `[in, out]`.

    Attributes:
      scales: `[..., m, n / 32]` float16, each block's $d$.
      mins: `[..., m, n / 32]` float16, each block's $m$ (Q4_1; None for the others).
      codes: `[..., m, n / 32, 32]` int8 (Q8_0), or `[..., m, n / 32, 16]` uint8 with two
        4-bit codes per byte (Q4_0, Q4_1).
      type_name: "Q8_0", "Q4_0" or "Q4_1" (`GGML_TYPES`).
      transposed: whether the array is the transpose of the stored matrix.
      value_dtype: the dtype the array is dequantised to.
    """

    # Untyped: pytree operations (abstract templates for checkpoints) put other leaves here.
    scales: Any
    mins: Any
    codes: Any
    type_name: str = eqx.field(static=True)
    transposed: bool = eqx.field(static=True)
    value_dtype: jnp.dtype = eqx.field(static=True)

    def aval(self) -> jax.core.ShapedArray:
        m, n = self.stored_shape
        shape = (*self.scales.shape[:-2], *((n, m) if self.transposed else (m, n)))
        return jax.core.ShapedArray(shape, self.value_dtype)

    @property
    def stored_shape(self) -> tuple[int, int]:
        """`(m, n)`, the rows and columns of the stored matrix."""
        m, blocks = self.scales.shape[-2:]
        return m, blocks * GGML_BLOCK_SIZE

    def dequantize(self, dtype: DTypeLike | None = None) -> Array:
        """The array, computed in float32 and cast to `dtype` (default `value_dtype`)."""
        return _dequantized(self, jnp.dtype(self.value_dtype if dtype is None else dtype))

    def materialise(self) -> Array:
        return self.dequantize()

    def with_dtype(self, dtype: DTypeLike) -> "GGMLTensor":
        """The same tensor, dequantising to `dtype`."""
        return dataclasses.replace(self, value_dtype=jnp.dtype(dtype))

    def transpose(self) -> "GGMLTensor":
        """The transposed array (no data moves; the flag flips)."""
        return dataclasses.replace(self, transposed=not self.transposed)

    @property
    def T(self) -> "GGMLTensor":
        return self.transpose()


# Compiled as one function, so that dequantising outside `jax.jit` costs one dispatch (and
# one compilation per shape), not one per operation.
@functools.partial(jax.jit, static_argnums=1)
def _dequantized(t: GGMLTensor, dtype: jnp.dtype) -> Array:
    values = decode_blocks(t.scales, t.mins, t.codes, t.type_name)
    out = values.reshape(*values.shape[:-2], -1)
    if t.transposed:
        out = jnp.swapaxes(out, -1, -2)
    return out.astype(dtype)


def decode_blocks(scales, mins, codes, type_name: str) -> Float[Array, "*S K 32"]:
    """The float32 values `[..., blocks, 32]` of blocks: $d q$, $d (q - 8)$ or $d q + m$.

    Each product of a float16 scale and a code of at most 8 bits is exact in float32, so
    the values equal ggml's and `gguf.quants.dequantize`'s whatever order or fusion XLA
    gives the operations (for Q4_1 only the addition of $m$ rounds).
    """
    d = scales.astype(jnp.float32)[..., None]
    if type_name == "Q8_0":
        return codes.astype(jnp.float32) * d
    q = jnp.concatenate([codes & 15, codes >> 4], axis=-1)
    if type_name == "Q4_0":
        return (q.astype(jnp.int32) - 8).astype(jnp.float32) * d
    return q.astype(jnp.float32) * d + mins.astype(jnp.float32)[..., None]


def _check_type(type_name: str) -> None:
    if type_name not in GGML_TYPES:
        raise ValueError(
            f"type_name {type_name!r} is not supported; the GGML block types kept quantised are "
            f"{', '.join(GGML_TYPES)} (dequantise other types, e.g. with "
            "tunelib.formats.gguf_tensors)."
        )


def _round_away(x: np.ndarray) -> np.ndarray:
    """Round half away from zero, as C's `roundf` (and `gguf.quants.np_roundf`)."""
    a = np.abs(x)
    floored = np.floor(a)
    return np.sign(x) * (floored + np.floor(2 * (a - floored)))


def _quantize_blocks(blocks: np.ndarray, type_name: str):
    """`(scales, mins, codes)` of float32 `blocks` `[..., 32]` by ggml's reference rules."""
    zero = np.float32(0)
    with np.errstate(divide="ignore"):
        if type_name == "Q8_0":
            d = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
            inverse = np.where(d == 0, zero, np.float32(1) / d)
            codes = _round_away(blocks * inverse).astype(np.int8)
            return d[..., 0].astype(np.float16), None, codes
        if type_name == "Q4_0":
            # The signed value of largest magnitude (the first, on a tie) maps to code 0.
            at = np.abs(blocks).argmax(axis=-1)[..., None]
            d = np.take_along_axis(blocks, at, axis=-1) / np.float32(-8)
            inverse = np.where(d == 0, zero, np.float32(1) / d)
            q = np.trunc(blocks * inverse + np.float32(8.5))
            low = None
        else:
            low = blocks.min(axis=-1, keepdims=True)
            d = (blocks.max(axis=-1, keepdims=True) - low) / np.float32(15)
            inverse = np.where(d == 0, zero, np.float32(1) / d)
            q = np.trunc((blocks - low) * inverse + np.float32(0.5))
    q = np.clip(q, 0, 15).astype(np.uint8)
    codes = q[..., :16] | (q[..., 16:] << 4)
    mins = None if low is None else low[..., 0].astype(np.float16)
    return d[..., 0].astype(np.float16), mins, codes


def ggml_quantize(
    x: Float[ArrayLike, "*S m n"],
    type_name: str,
    *,
    transpose: bool = False,
) -> GGMLTensor:
    r"""Quantise matrices to GGML blocks of 32 along each row, as llama.cpp and `gguf` do.

    For a block $x_1, \dots, x_{32}$ of a row:

    * Q8_0: $d = \max_i |x_i| / 127$, $q_i = \mathrm{round}(x_i / d)$ (half away from zero);
    * Q4_0: with $x_M$ the element of largest magnitude, $d = x_M / {-8}$,
      $q_i = \min(15, \lfloor x_i / d + 8.5 \rfloor)$, so $x_M$ gets code 0;
    * Q4_1: $d = (\max_i x_i - \min_i x_i) / 15$, $m = \min_i x_i$,
      $q_i = \min(15, \lfloor (x_i - m) / d + 0.5 \rfloor)$;

    with $d$ and $m$ stored in float16 and $1/d$ computed in float32 (0 when $d = 0$). The
    codes and scales equal `gguf.quants.quantize`'s byte for byte. Quantisation runs on the
    host in NumPy float32, as the `gguf` package's does: under XLA a product and the sum
    that follows it may be fused into one FMA, which rounds once and picks a neighbouring
    code for a few elements in a million.

    Args:
      x: `[..., m, n]` floating-point weights, `n` a multiple of 32 (converted to float32).
      type_name: "Q8_0", "Q4_0" or "Q4_1".
      transpose: store `x`'s transpose `[n, m]` (blocks along `m`) and stand for `x`: a JAX
        kernel `[in, out]` is then stored in a GGUF file's `[out, in]` layout.

    Returns:
      A `GGMLTensor` standing for `x` (dequantising to `x`'s dtype).

    Raises:
      ValueError: for another type, fewer than 2 dimensions, or rows not of whole blocks.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from tunelib.peft import ggml_quantize, bits_per_parameter
      >>> w = jax.random.normal(jax.random.key(0), (256, 128))
      >>> q = ggml_quantize(w, "Q8_0", transpose=True)  # a kernel [in, out]
      >>> print(q.shape, q.stored_shape, q.codes.shape, q.codes.dtype, q.scales.dtype)
      (256, 128) (128, 256) (128, 8, 32) int8 float16
      >>> print(bool(jnp.abs(q.dequantize() - w).max() < 0.01 * jnp.abs(w).max()))
      True
      >>> print(bits_per_parameter(q), bits_per_parameter(ggml_quantize(w, "Q4_1")))
      8.5 5.0

    References:
      ggml's reference quantisers `quantize_row_q8_0_ref`, `quantize_row_q4_0_ref` and
      `quantize_row_q4_1_ref`, https://github.com/ggml-org/llama.cpp (ggml/src/ggml-quants.c).
    """
    _check_type(type_name)
    dtype = jax.dtypes.canonicalize_dtype(getattr(x, "dtype", None) or np.asarray(x).dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"x must be a floating-point array, got dtype {dtype}.")
    values = np.asarray(jax.device_get(x), np.float32)
    if values.ndim < 2:
        raise ValueError(f"x must have at least 2 dimensions, got shape {values.shape}.")
    if transpose:
        values = np.swapaxes(values, -1, -2)
    if values.shape[-1] % GGML_BLOCK_SIZE:
        axis = "first" if transpose else "last"
        raise ValueError(
            f"x's rows must be whole blocks of {GGML_BLOCK_SIZE}: the size of its {axis} "
            f"axis must be a multiple of {GGML_BLOCK_SIZE}, got shape {np.shape(x)}."
        )
    blocks = values.reshape(*values.shape[:-1], -1, GGML_BLOCK_SIZE)
    scales, mins, codes = _quantize_blocks(blocks, type_name)
    return GGMLTensor(
        scales=jnp.asarray(scales),
        mins=None if mins is None else jnp.asarray(mins),
        codes=jnp.asarray(codes),
        type_name=type_name,
        transposed=transpose,
        value_dtype=jnp.dtype(dtype),
    )


def ggml_from_bytes(
    data: ArrayLike,
    type_name: str,
    shape: Sequence[int],
    *,
    rows: ArrayLike | None = None,
    transpose: bool = False,
    dtype: DTypeLike = "float32",
) -> GGMLTensor:
    """A `GGMLTensor` from a tensor's bytes as a GGUF file stores them (nothing dequantised).

    Args:
      data: uint8, the tensor's bytes in the file's order (any shape; a memory map from
        `tunelib.formats.gguf_raw_tensors` is read once).
      type_name: "Q8_0", "Q4_0" or "Q4_1" (`GGUFTensor.type_name`).
      shape: the matrix `[m, n]` the bytes encode, a Hugging Face weight's `[out, in]`
        (`GGUFTensor.shape`); `n` is a multiple of 32.
      rows: the stored matrix's rows in the order to keep them (`rows[i]` becomes row `i`),
        or None: the `rows` that `gguf_raw_tensors` gives for Llama's query and key weights
        undo llama.cpp's rotary interleaving by moving whole rows of blocks.
      transpose: stand for the transpose `[n, m]` (a JAX kernel `[in, out]`).
      dtype: the dtype the tensor dequantises to.

    Returns:
      A `GGMLTensor` of `len(rows)` (or `m`) stored rows.

    Examples:
      >>> import gguf, numpy as np
      >>> from tunelib.peft import ggml_from_bytes
      >>> w = np.linspace(-1, 1, 2 * 64, dtype=np.float32).reshape(2, 64)
      >>> data = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
      >>> q = ggml_from_bytes(data, "Q4_1", (2, 64))
      >>> print(data.shape, q.shape, q.codes.shape)
      (2, 40) (2, 64) (2, 2, 16)
      >>> reference = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.Q4_1)
      >>> print(bool((np.asarray(q.dequantize()) == reference).all()))
      True
    """
    _check_type(type_name)
    data = np.asarray(data)
    if data.dtype != np.uint8:
        raise TypeError(f"data must be uint8 bytes, got dtype {data.dtype}.")
    m, n = (int(s) for s in shape)
    if n % GGML_BLOCK_SIZE:
        raise ValueError(f"shape {tuple(shape)}: rows must be whole blocks of {GGML_BLOCK_SIZE}.")
    blocks = n // GGML_BLOCK_SIZE
    size = _BLOCK_BYTES[type_name]
    if data.size != m * blocks * size:
        raise ValueError(
            f"data holds {data.size} bytes, but a {type_name} matrix of shape {tuple(shape)} "
            f"takes {m * blocks * size}."
        )
    data = data.reshape(m, blocks, size)
    if rows is not None:
        data = data[np.asarray(rows)]

    def half(start: int) -> np.ndarray:
        return np.ascontiguousarray(data[..., start : start + 2]).view(np.float16)[..., 0]

    start = 4 if type_name == "Q4_1" else 2
    codes = np.ascontiguousarray(data[..., start:])
    return GGMLTensor(
        scales=jnp.asarray(half(0)),
        mins=jnp.asarray(half(2)) if type_name == "Q4_1" else None,
        codes=jnp.asarray(codes.view(np.int8) if type_name == "Q8_0" else codes),
        type_name=type_name,
        transposed=transpose,
        value_dtype=jnp.dtype(dtype),
    )


def gguf_base(
    model: str | os.PathLike | GGUFModel,
    options: LoadOptions | None = None,
    *,
    patterns: Sequence[str] = (PROJECTION_KERNELS,),
    **keywords: Any,
) -> HFCheckpoint:
    """A GGUF model as the decoder's parameters, its quantised blocks kept as a QLoRA base.

    The weights that `patterns` select and that the file stores in Q8_0, Q4_0 or Q4_1 become
    `GGMLTensor`s built from the file's bytes (`ggml_from_bytes`): kernels `[in, out]` that
    keep the file's `[out, in]` blocks, the embedding `[V, H]` as it is. Every other weight
    is dequantised with the `gguf` package into `param_dtype`. Llama's query and key rows
    are put back in Hugging Face order (for blocks, by moving whole rows). Dequantised, the
    parameters equal those of `load_hf_checkpoint(convert_gguf(path, ...))` exactly, and no
    float copy of a kept weight is ever made. The parameters are placed on the default
    device, or with `mesh` sharded as `load_hf_checkpoint` shards them: a kept weight's
    blocks are split along the stored matrix's rows and block columns as the weight is along
    its output and input axes (an axis whose block count the mesh axis does not divide is
    replicated). A selected weight that the file stores as floats (F32, F16, BF16) stays
    dense.

    Args:
      model: a `.gguf` file, or the `GGUFModel` that `tunelib.formats.read_gguf` read.
      patterns: regular expressions over `/`-joined parameter paths (`re.fullmatch`) of the
        weights to keep quantised: the projections (`PROJECTION_KERNELS`) by default; add
        `"embed_tokens/embedding"` to keep the token embedding (and, when tied, the
        unembedding) too.
      options: how to load it (`tunelib.formats.LoadOptions`; None means its defaults):
        `param_dtype` is the dtype of the dense parameters and of the kept tensors' values;
        with `scan_layers` each kept weight's blocks are stacked too, so every layer's must
        be of one type; the parameters are placed by `mesh` and `rules` (`shardings` must
        be None).
      **keywords: fields of `LoadOptions` by name, replacing those of `options`.

    Returns:
      An `HFCheckpoint` `(graphdef, params, config, hf_config)` (`params` with `GGMLTensor`
      leaves; run the model through `tunelib.peft.lora`).

    Raises:
      ValueError: naming the tensor, for a selected weight of another quantised type (K
        quants, Q5_0, ...), stacked layers of different types, a tensor missing from the file,
        unexpected or of the wrong shape, a pattern that selects nothing, or `shardings`.
      TypeError: for a keyword argument that is not a field of `LoadOptions`.

    Examples:
      >>> import tempfile, gguf, jax, jax.numpy as jnp, numpy as np
      >>> from flax import nnx
      >>> from tunelib import peft
      >>> from tunelib.models import PROJECTION_KERNELS
      >>> path = tempfile.mkdtemp() + "/tiny.gguf"
      >>> writer = gguf.GGUFWriter(path, "llama")
      >>> for key, value in {"block_count": 1, "embedding_length": 64,
      ...                    "feed_forward_length": 64, "attention.head_count": 2,
      ...                    "vocab_size": 16}.items():
      ...     writer.add_uint32(f"llama.{key}", value)
      >>> rng = np.random.default_rng(0)
      >>> q4 = gguf.GGMLQuantizationType.Q4_1
      >>> for name in ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
      ...              "ffn_down"]:
      ...     w = rng.normal(size=(64, 64)).astype(np.float32) / 8
      ...     writer.add_tensor(f"blk.0.{name}.weight", gguf.quants.quantize(w, q4), raw_dtype=q4)
      >>> for name in ["blk.0.attn_norm", "blk.0.ffn_norm", "output_norm"]:
      ...     writer.add_tensor(f"{name}.weight", np.ones(64, np.float32))
      >>> writer.add_tensor("token_embd.weight", rng.normal(size=(16, 64)).astype(np.float32))
      >>> writer.write_header_to_file(); writer.write_kv_data_to_file()
      >>> writer.write_tensors_to_file(); writer.close()
      >>> graphdef, params, config, _ = peft.gguf_base(path)
      >>> kernel = params["layers"][0]["self_attn"]["q_proj"]["kernel"]
      >>> print(type(kernel).__name__, kernel.type_name, kernel.shape, kernel.stored_shape)
      GGMLTensor Q4_1 (64, 64) (64, 64)
      >>> rule = peft.LoraRule(pattern=PROJECTION_KERNELS, rank=4)
      >>> adapters = peft.init_lora(params, [rule], key=jax.random.key(0))
      >>> def forward(params, tokens):
      ...     return nnx.merge(graphdef, params)(tokens)
      >>> hidden = jax.jit(peft.lora(forward))(peft.apply_lora(params, adapters),
      ...                                      jnp.array([[1, 2, 3]]))
      >>> dense = forward(peft.dequantize_params(params), jnp.array([[1, 2, 3]]))
      >>> print(hidden.shape, bool(jnp.allclose(hidden, dense, atol=1e-5)))
      (1, 3, 64) True
    """
    options = LoadOptions.from_arguments(options, **keywords)
    if options.shardings is not None:
        raise ValueError("gguf_base places the parameters by options.mesh; shardings must be None.")
    if not isinstance(model, GGUFModel):
        model = read_gguf(model)
    config = config_from_hf(
        model.hf_config,
        dtype=options.dtype,
        param_dtype=options.param_dtype,
        scan_layers=options.scan_layers,
        remat=options.remat,
    )
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    abstract = nnx.to_pure_dict(state)
    kept = match_rules(abstract, patterns, what="GGUF block pattern")
    raw = {tensor.hf_name: (tensor, data, rows) for tensor, data, rows in gguf_raw_tensors(model)}
    names = {}
    for path, spec in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        names[path_string(path)] = _hf_names(path_string(path), options.scan_layers, spec.shape)
    _check_tensors(model, raw, names, abstract)
    refused = [
        f"{raw[hf_name][0].gguf_name!r} ({raw[hf_name][0].type_name})"
        for name in kept
        for hf_name in names[name]
        if raw[hf_name][0].type_name not in GGML_TYPES + _FLOAT_TYPES
    ]
    if refused:
        raise ValueError(
            f"{model.path}: patterns select tensors of types that cannot be kept quantised: "
            f"{', '.join(refused[:8])}{' and more' if len(refused) > 8 else ''}; the GGML "
            f"block types kept are {', '.join(GGML_TYPES)}. Leave these out of patterns to "
            "dequantise them."
        )
    target = jnp.dtype(options.param_dtype)

    def load(path, spec):
        name = path_string(path)
        keep = name in kept
        types = sorted({raw[hf_name][0].type_name for hf_name in names[name]})
        if keep and len(types) > 1:
            raise ValueError(
                f"{name!r} stacks layers stored in different types ({', '.join(types)}); "
                "load it with scan_layers=False."
            )
        parts = [
            _load_tensor(*raw[hf_name], keep=keep, kernel=name.endswith("/kernel"), dtype=target)
            for hf_name in names[name]
        ]
        if options.scan_layers and name.startswith("layers/"):
            return jax.tree.map(lambda *layers: jnp.stack(layers), *parts)
        return parts[0]

    params = jax.tree_util.tree_map_with_path(load, abstract)
    if options.mesh is not None:
        shardings = param_shardings(graphdef, abstract, options.mesh, options.rules)
        params = jax.tree.map(
            _placed, params, shardings, is_leaf=lambda x: isinstance(x, GGMLTensor)
        )
    return HFCheckpoint(graphdef, params, config, model.hf_config)


def _placed(leaf, sharding: jax.sharding.NamedSharding):
    """A parameter put on the mesh: an array with `sharding`; a `GGMLTensor`'s block fields
    split as the array it stands for is split (see `gguf_base`)."""
    if not isinstance(leaf, GGMLTensor):
        return jax.device_put(leaf, sharding)
    spec = (*sharding.spec, *(None,) * (len(leaf.shape) - len(sharding.spec)))
    *lead, first, second = spec
    rows, columns = (second, first) if leaf.transposed else (first, second)
    blocks = leaf.scales.shape[-1]
    if columns is not None and blocks % _axis_size(sharding.mesh, columns):
        columns = None

    def put(field, extra):
        if field is None:
            return None
        named = jax.sharding.PartitionSpec(*lead, rows, columns, *extra)
        return jax.device_put(field, jax.sharding.NamedSharding(sharding.mesh, named))

    return dataclasses.replace(
        leaf, scales=put(leaf.scales, ()), mins=put(leaf.mins, ()), codes=put(leaf.codes, (None,))
    )


def _axis_size(mesh: jax.sharding.Mesh, axes) -> int:
    names = axes if isinstance(axes, tuple) else (axes,)
    return int(np.prod([mesh.shape[name] for name in names]))


def _hf_names(path: str, scan_layers: bool, shape: tuple[int, ...]) -> list[str]:
    """The Hugging Face tensor names a parameter is made of (one per layer when stacked)."""
    *modules, leaf = path.split("/")
    suffix = "bias" if leaf == "bias" else "weight"
    if scan_layers and modules[0] == "layers":
        return [
            f"{hf_module_name('/'.join(['layers', str(i), *modules[1:], leaf]))}.{suffix}"
            for i in range(shape[0])
        ]
    return [f"{hf_module_name(path)}.{suffix}"]


def _check_tensors(model: GGUFModel, raw: dict, names: dict, abstract) -> None:
    """Raise naming the tensors missing from the file, unexpected in it, or misshapen."""
    wanted = {n for group in names.values() for n in group}
    missing, unexpected = sorted(wanted - set(raw)), sorted(set(raw) - wanted)
    if missing or unexpected:
        raise ValueError(
            f"{model.path}: the tensors do not match the config: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}."
        )
    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    specs = {path_string(path): spec for path, spec in leaves}
    for name, group in names.items():
        shape = specs[name].shape[1:] if len(group) > 1 else specs[name].shape
        hf_shape = shape[::-1] if name.endswith("/kernel") else shape
        for hf_name in group:
            if raw[hf_name][0].shape != tuple(hf_shape):
                raise ValueError(
                    f"{model.path}: tensor {hf_name!r} has shape {raw[hf_name][0].shape}, but "
                    f"the config implies {tuple(hf_shape)}."
                )


def _load_tensor(tensor, data, rows, *, keep: bool, kernel: bool, dtype) -> Any:
    """One tensor of the file: a `GGMLTensor` when kept (and of a GGML block type), else
    dense in `dtype`."""
    import gguf

    if keep and tensor.type_name in GGML_TYPES:
        return ggml_from_bytes(
            data, tensor.type_name, tensor.shape, rows=rows, transpose=kernel, dtype=dtype
        )
    qtype = gguf.GGMLQuantizationType[tensor.type_name]
    values = gguf.quants.dequantize(data, qtype).astype(np.float32, copy=False)
    values = values.reshape(tensor.shape)
    if rows is not None:
        values = values[rows]
    return jnp.asarray((values.T if kernel else values).astype(np.dtype(dtype)))
