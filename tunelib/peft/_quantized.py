r"""Quantised base weights in a parameter tree, and their matrix products.

A product with an `NF4Tensor`, `Int8Tensor` or `GGMLTensor` inside `lora(fn)` dequantises the
weight (in float32, cast to the compute dtype) and multiplies, under a custom VJP whose only
residuals are the stored codes and constants: the dequantised weight exists only while one
layer's product runs, in the forward pass and again in the backward pass, never for the whole
model. Grouped products over stacked experts (`tunelib.models.grouped_matmul`) do the same.
An embedding lookup in a quantised table dequantises only the rows it takes.
"""

import functools
from collections.abc import Sequence
from typing import Literal

import jax
import jax.numpy as jnp
import quax
from jax import lax
from jaxtyping import Array, ArrayLike, PyTree

from tunelib.models import grouped_matmul_p
from tunelib.peft._gguf_blocks import GGMLTensor, decode_blocks
from tunelib.peft._int8 import Int8Tensor, int8_quantize
from tunelib.peft._nf4 import (
    NF4_VALUES,
    NF4Tensor,
    gathers,
    nf4_quantize,
    table_lookup,
    unpack_nibbles,
)
from tunelib.peft._rules import Layout, match_rules, path_string

QuantFormat = Literal["nf4", "int8"]
QUANT_FORMATS: tuple[str, ...] = QuantFormat.__args__
Quantized = NF4Tensor | Int8Tensor | GGMLTensor


def quantize_params(
    params: PyTree,
    patterns: Sequence[str],
    *,
    format: QuantFormat = "nf4",
    layout: Layout = "in_out",
    double_quant: bool = True,
    block_size: int = 64,
    matmul: Literal["xla", "pallas"] = "xla",
    allow_unmatched: bool = False,
) -> PyTree:
    """`params` with the weights that `patterns` select replaced by quantised tensors.

    NF4 tensors store each matrix in the `[out, in]` layout of PyTorch and bitsandbytes: with
    `layout="in_out"` (kernels used as `x @ W`, the JAX convention) the kernel is transposed
    before quantising, so its codes and block constants equal those bitsandbytes computes for
    the same Hugging Face weight. Int8 tensors get one scale per output channel.

    Args:
      params: the base parameters.
      patterns: regular expressions over `/`-joined parameter paths (`re.fullmatch`), as in
        `LoraRule`; typically the same weights the adapters go on.
      format: "nf4" (QLoRA) or "int8" (absmax per output channel).
      layout: "in_out" (`x @ W`) or "out_in" (`x @ W.T`, the weight is `[out, in]`).
      double_quant: NF4 only: double-quantise the block absmax values.
      block_size: NF4 only: elements per block.
      matmul: NF4 only: "xla" (dequantise per product, then XLA's matmul) or "pallas" (the
        dequantise-and-multiply kernel `tunelib.kernels.nf4_matmul_pallas`; measured on CPU
        in the interpreter only, so not the default).
      allow_unmatched: warn instead of raising when a pattern selects nothing.

    Returns:
      A pytree like `params` with `NF4Tensor` or `Int8Tensor` leaves at the selected paths.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from tunelib import peft
      >>> params = {"proj": {"kernel": jax.random.normal(jax.random.key(0), (256, 128))},
      ...           "norm": jnp.ones(256)}
      >>> base = peft.quantize_params(params, [r".*kernel"])
      >>> print(type(base["proj"]["kernel"]).__name__, base["proj"]["kernel"].shape)
      NF4Tensor (256, 128)
      >>> print(base["proj"]["kernel"].stored_shape)  # the [out, in] layout
      (128, 256)
    """
    if format not in QUANT_FORMATS:
        raise ValueError(f"format must be one of {QUANT_FORMATS}, got {format!r}.")
    if layout not in Layout.__args__:
        raise ValueError(f"layout must be one of {Layout.__args__}, got {layout!r}.")
    selected = match_rules(
        params, patterns, allow_unmatched=allow_unmatched, what="quantisation pattern"
    )

    def quantize(path, leaf):
        if path_string(path) not in selected:
            return leaf
        if isinstance(leaf, quax.ArrayValue):
            raise ValueError(f"{path_string(path)!r} is already quantised.")
        if format == "int8":
            return _int8_quantize(leaf, channel_axis=-1 if layout == "in_out" else -2)
        return _nf4_quantize(
            leaf,
            block_size=block_size,
            double_quant=double_quant,
            transpose=layout == "in_out",
            matmul=matmul,
        )

    return jax.tree_util.tree_map_with_path(
        quantize, params, is_leaf=lambda x: isinstance(x, quax.ArrayValue)
    )


# Each weight quantised (and dequantised) by one compiled program per shape and options: run
# op by op, every distinct shape would compile each of the quantiser's operations on its own.
_int8_quantize = functools.partial(jax.jit, static_argnames="channel_axis")(int8_quantize)
_nf4_quantize = functools.partial(
    jax.jit, static_argnames=("block_size", "double_quant", "transpose", "matmul")
)(nf4_quantize)
_dequantize = jax.jit(lambda x: x.dequantize())


def dequantize_params(params: PyTree) -> PyTree:
    """`params` with every quantised tensor replaced by its dense array."""
    return jax.tree.map(
        lambda x: _dequantize(x) if isinstance(x, Quantized) else x,
        params,
        is_leaf=lambda x: isinstance(x, Quantized),
    )


# ----------------------------------------------------------------------------- dispatch rules


def _pallas_eligible(x: Array, weight, dimension_numbers, weight_is_rhs: bool) -> bool:
    """The Pallas kernel's case: `x [..., in] @ W [in, out]`, W one NF4 matrix stored
    `[out, in]` whose rows are whole blocks."""
    if not (isinstance(weight, NF4Tensor) and weight.matmul == "pallas" and weight_is_rhs):
        return False
    (x_contract, w_contract), batch = dimension_numbers
    _, k = weight.stored_shape
    return (
        weight.transposed
        and weight.ndim == 2
        and batch == ((), ())
        and tuple(x_contract) == (x.ndim - 1,)
        and tuple(w_contract) == (0,)
        and k % weight.block_size == 0
        and weight.block_size % 2 == 0
    )


def quantized_dot_general(x: Array, weight, dimension_numbers, params, weight_is_rhs: bool):
    """`dot_general` of `x` with a quantised weight, dequantised inside a custom VJP."""
    if _pallas_eligible(x, weight, dimension_numbers, weight_is_rhs):
        from tunelib.kernels import nf4_matmul_pallas

        n, k = weight.stored_shape
        dtype = jnp.result_type(x.dtype, weight.dtype)
        out = nf4_matmul_pallas(
            x.reshape(-1, k).astype(dtype),
            weight.codes.reshape(n, k // 2),
            weight.block_absmax().reshape(n, k // weight.block_size),
            table=tuple(NF4_VALUES.tolist()),
            block_size=weight.block_size,
            out_dtype=params.get("preferred_element_type") or dtype,
        )
        return out.reshape(*x.shape[:-1], n)
    x_struct = jax.ShapeDtypeStruct(x.shape, x.dtype)

    def product(x, weight):
        dense = weight.dequantize()
        args = (x, dense) if weight_is_rhs else (dense, x)
        return lax.dot_general(*args, dimension_numbers, **params)

    @jax.custom_vjp
    def matmul(x, weight):
        return product(x, weight)

    def forward(x, weight):
        return product(x, weight), weight

    def backward(weight, cotangent):
        (dx,) = jax.linear_transpose(lambda x: product(x, weight), x_struct)(cotangent)
        return dx, None  # the base is frozen

    matmul.defvjp(forward, backward)
    return matmul(x, weight)


def quantized_grouped_matmul(x: Array, weight, group_sizes: Array, params):
    """A grouped product (stacked experts) with a quantised weight, dequantised inside a
    custom VJP as `quantized_dot_general` does."""
    x_struct = jax.ShapeDtypeStruct(x.shape, x.dtype)

    def product(x, weight, group_sizes):
        return grouped_matmul_p.bind(x, weight.dequantize(), group_sizes, **params)

    @jax.custom_vjp
    def matmul(x, weight, group_sizes):
        return product(x, weight, group_sizes)

    def forward(x, weight, group_sizes):
        return product(x, weight, group_sizes), (weight, group_sizes)

    def backward(saved, cotangent):
        weight, group_sizes = saved
        transpose = jax.linear_transpose(lambda x: product(x, weight, group_sizes), x_struct)
        return transpose(cotangent)[0], None, None  # the base is frozen

    matmul.defvjp(forward, backward)
    return matmul(x, weight, group_sizes)


def _register(cls) -> None:
    @quax.register(grouped_matmul_p)
    def _grouped(x: ArrayLike, w: cls, group_sizes: ArrayLike, **params) -> Array:
        return quantized_grouped_matmul(jnp.asarray(x), w, jnp.asarray(group_sizes), params)

    @quax.register(lax.dot_general_p)
    def _dot_right(lhs: ArrayLike, rhs: cls, *, dimension_numbers, **params) -> Array:
        return quantized_dot_general(jnp.asarray(lhs), rhs, dimension_numbers, params, True)

    @quax.register(lax.dot_general_p)
    def _dot_left(lhs: cls, rhs: ArrayLike, *, dimension_numbers, **params) -> Array:
        return quantized_dot_general(jnp.asarray(rhs), lhs, dimension_numbers, params, False)

    @quax.register(lax.convert_element_type_p)
    def _cast(x: cls, *, new_dtype, **params) -> cls:
        del params
        return x.with_dtype(new_dtype)

    @quax.register(lax.gather_p)
    def _lookup(operand: cls, indices: ArrayLike, **params) -> Array:
        return _gather(operand, indices, **params)

    @quax.register(lax.transpose_p)
    def _transpose(x: cls, *, permutation) -> cls | Array:
        n = len(permutation)
        if n >= 2 and tuple(permutation) == (*range(n - 2), n - 1, n - 2):
            return x.transpose()
        return lax.transpose(x.dequantize(), permutation)


def _gathers_rows(weight, indices, dimension_numbers, slice_sizes) -> bool:
    """Whether a gather takes whole rows of a 2-D weight, as an embedding lookup does."""
    numbers = dimension_numbers
    return (
        weight.ndim == 2
        and tuple(slice_sizes) == (1, weight.shape[1])
        and tuple(numbers.offset_dims) == (indices.ndim - 1,)
        and tuple(numbers.collapsed_slice_dims) == (0,)
        and tuple(numbers.start_index_map) == (0,)
        and not numbers.operand_batching_dims
        and indices.shape[-1] == 1
    )


def _row_values(weight, rows: Array) -> Array:
    """Rows `rows` (in range) of a quantised weight, dequantising only those rows."""
    if isinstance(weight, Int8Tensor):
        scale = weight.scale[rows][..., None] if weight.channel_axis == -2 else weight.scale
        return (weight.values[rows].astype(jnp.float32) * scale).astype(weight.dtype)
    if isinstance(weight, GGMLTensor):
        mins = None if weight.mins is None else weight.mins[rows]
        values = decode_blocks(weight.scales[rows], mins, weight.codes[rows], weight.type_name)
        return values.reshape(*rows.shape, -1).astype(weight.dtype)
    m, n = weight.stored_shape
    codes = unpack_nibbles(weight.codes.reshape(m, n // 2)[rows], n)
    absmax = weight.block_absmax().reshape(m, n // weight.block_size)[rows]
    values = table_lookup(codes, NF4_VALUES, gather=gathers(NF4_VALUES))
    values = values.reshape(*rows.shape, -1, weight.block_size) * absmax[..., None]
    return values.reshape(*rows.shape, n).astype(weight.dtype)


def _gather(weight, indices, *, dimension_numbers, slice_sizes, mode, fill_value, **params):
    """An embedding lookup in a quantised table dequantises the looked-up rows only."""
    indices = jnp.asarray(indices)
    # A row of the array must be a row of the stored matrix, of whole blocks.
    whole_blocks = isinstance(weight, Int8Tensor) or (
        not weight.transposed
        and (isinstance(weight, GGMLTensor) or weight.stored_shape[1] % weight.block_size == 0)
    )
    if not (whole_blocks and _gathers_rows(weight, indices, dimension_numbers, slice_sizes)):
        return lax.gather(
            weight.dequantize(), indices, dimension_numbers, tuple(slice_sizes),
            mode=mode, fill_value=fill_value, **params,
        )  # fmt: skip
    rows = indices[..., 0]
    inside = (rows >= 0) & (rows < weight.shape[0])
    out = _row_values(weight, jnp.clip(rows, 0, weight.shape[0] - 1))
    if mode == lax.GatherScatterMode.FILL_OR_DROP:
        fill = jnp.nan if fill_value is None else fill_value
        out = jnp.where(inside[..., None], out, jnp.asarray(fill, out.dtype))
    return out


for _cls in (NF4Tensor, Int8Tensor, GGMLTensor):
    _register(_cls)
