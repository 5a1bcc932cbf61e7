r"""4-bit NormalFloat (NF4) quantisation with double-quantised block constants (QLoRA).

The layout is that of bitsandbytes, so a tensor quantised here has the same codes, packed
bytes and block constants as `bitsandbytes.functional.quantize_4bit(..., quant_type="nf4")`:

* blocks of `block_size` (64) consecutive elements of the row-major flattened matrix, each
  with its float32 absolute maximum $m_b$;
* every element $w$ becomes the index of the NF4 value nearest to $w / m_b$ (a tie goes to the
  lower index);
* two 4-bit codes per byte, the even element in the high nibble; an odd tail is padded with
  the code of 0.0;
* double quantisation: the absmax values minus their mean (one float32 offset per tensor) are
  quantised blockwise (256 per block) to 8 bits with the signed dynamic map.
"""

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import quax
from jax.typing import ArrayLike, DTypeLike
from jaxtyping import Array, Float, UInt8

from tunelib import _validation as v

# The 16 NF4 values of Dettmers et al. (2023), bit-exact as float32, ascending for codes 0..15.
NF4_VALUES = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=np.float32,
)
NF4_ZERO_CODE = 7


def signed_dynamic_map() -> np.ndarray:
    r"""The 256 values of the signed 8-bit dynamic map that double quantisation uses.

    For $i = 0, \dots, 6$: the $2^i$ midpoints of `linspace(0.1, 1, 2^i + 1)` times
    $10^{i - 6}$, with both signs; then 0 and 1; sorted. Each value is computed in float64
    and rounded once to float32. bitsandbytes' `create_dynamic_map(signed=True)` builds the
    same table from a float32 `torch.linspace`, which differs from it by at most one float32
    ulp (6e-8) in some entries; a bitsandbytes checkpoint stores its own table.

    Returns:
      `[256]` float32, ascending.

    Examples:
      >>> from tunelib.peft import signed_dynamic_map
      >>> table = signed_dynamic_map()
      >>> print(table.shape, table[0], table[126], table[127], table[128], table[-1])
      (256,) -0.99296874 -5.5e-07 0.0 5.5e-07 1.0
    """
    values = [0.0, 1.0]
    for i in range(7):
        bounds = np.linspace(0.1, 1.0, 2**i + 1)
        means = (bounds[:-1] + bounds[1:]) / 2
        values += list(10.0 ** (i - 6) * means) + list(-(10.0 ** (i - 6)) * means)
    return np.sort(np.asarray(values, np.float64)).astype(np.float32)


DYNAMIC_MAP = signed_dynamic_map()


class NF4Tensor(quax.ArrayValue):
    """A matrix (or a stack of matrices) stored as NF4 codes and block constants.

    It stands in for the array it quantises: inside a function wrapped by
    `tunelib.peft.lora` it behaves like that array, and a matrix product with it
    dequantises the weight per call, under a custom VJP that keeps only the packed codes for
    the backward pass. `dequantize()` gives the array.

    The stored matrix of each leading index is `stored_shape` `[m, n]`, flattened row-major
    and quantised in blocks of `block_size` consecutive elements. With `transposed` it stands
    for the transpose `[n, m]`: a kernel `[in, out]` is stored in the `[out, in]` layout of
    PyTorch and bitsandbytes.

    Attributes:
      codes: `[..., ceil(m n / 2)]` uint8, two codes per byte, even element high.
      absmax: `[..., blocks]` the absmax of every block: float32, or with double quantisation
        the uint8 indices into `DYNAMIC_MAP`.
      absmax_scale: `[..., ceil(blocks / absmax_block_size)]` float32 absmax of each block of
        absmax values (double quantisation only, else None).
      absmax_offset: `[...]` float32 mean of the absmax values (double quantisation only).
      stored_shape: `(m, n)`.
      transposed: whether the array is the transpose of the stored matrix.
      value_dtype: the dtype the array is dequantised to.
      block_size: elements per block (64).
      absmax_block_size: absmax values per block of the double quantisation (256).
      matmul: how a product with it runs: "xla" (dequantise, then XLA's matmul) or "pallas"
        (`tunelib.kernels.nf4_matmul_pallas`, which never forms the dense weight; it applies
        to an unstacked `[in, out]` matrix stored `[out, in]` whose rows are whole blocks,
        other products fall back to "xla").
    """

    # Untyped: pytree operations (abstract templates for checkpoints) put other leaves here.
    codes: Any
    absmax: Any
    absmax_scale: Any
    absmax_offset: Any
    stored_shape: tuple[int, int] = eqx.field(static=True)
    transposed: bool = eqx.field(static=True)
    value_dtype: jnp.dtype = eqx.field(static=True)
    block_size: int = eqx.field(static=True)
    absmax_block_size: int = eqx.field(static=True)
    matmul: str = eqx.field(static=True, default="xla")

    def aval(self) -> jax.core.ShapedArray:
        shape = (*self.codes.shape[:-1], *self._matrix_shape())
        return jax.core.ShapedArray(shape, self.value_dtype)

    def _matrix_shape(self) -> tuple[int, int]:
        m, n = self.stored_shape
        return (n, m) if self.transposed else (m, n)

    @property
    def double_quantized(self) -> bool:
        return self.absmax_scale is not None

    def block_absmax(self) -> Float[Array, "*S B"]:
        """The float32 absmax of every block (dequantised when double-quantised)."""
        if not self.double_quantized:
            return self.absmax
        scale = jnp.repeat(self.absmax_scale, self.absmax_block_size, axis=-1)
        scale = scale[..., : self.absmax.shape[-1]]
        values = table_lookup(self.absmax, DYNAMIC_MAP, gather=gathers(DYNAMIC_MAP))
        return values * scale + self.absmax_offset[..., None]

    def dequantize(self, dtype: DTypeLike | None = None) -> Array:
        """The array, computed in float32 and cast to `dtype` (default `value_dtype`).

        The codes are decoded block by block, a block along the minor axis (`[..., m,
        n / block, block]` when rows are whole blocks, else `[..., blocks, block]`), each
        table looked up as `gathers` says. On a TPU v5e, decoding a 4,096 x 14,336 weight
        from one flat axis of codes, as it was first written, asked for 15.3 GB of
        temporaries and took 69.1 ms; by rows of blocks it takes 0.47 GB and 3.0 ms
        (docs/tpu.md, "NF4 on a TPU"). Rows that are not whole blocks decode from one
        axis of blocks cut from the packed bytes: 0.47 GB there at 4,100 x 14,336.
        """
        m, n = self.stored_shape
        size, block = m * n, self.block_size
        lead = self.codes.shape[:-1]
        absmax = self.block_absmax()
        if block % 2:  # blocks straddle bytes: decode the flat codes, then block them
            codes = _blocks(unpack_nibbles(self.codes, size), block)
        elif n % block == 0:  # rows of whole blocks
            codes = unpack_nibbles(self.codes.reshape(*lead, m, n // 2), n)
            codes = codes.reshape(*lead, m, n // block, block)
            absmax = absmax.reshape(*lead, m, n // block)
        else:
            packed = _blocks(self.codes, block // 2)
            codes = unpack_nibbles(packed, block)
        out = table_lookup(codes, NF4_VALUES, gather=gathers(NF4_VALUES)) * absmax[..., None]
        out = out.reshape(*lead, -1)[..., :size].reshape(*lead, m, n)
        if self.transposed:
            out = jnp.swapaxes(out, -1, -2)
        return out.astype(self.value_dtype if dtype is None else dtype)

    def materialise(self) -> Array:
        return self.dequantize()

    def with_dtype(self, dtype: DTypeLike) -> "NF4Tensor":
        """The same tensor, dequantising to `dtype`."""
        return dataclasses.replace(self, value_dtype=jnp.dtype(dtype))

    def transpose(self) -> "NF4Tensor":
        """The transposed array (no data moves; the flag flips)."""
        return dataclasses.replace(self, transposed=not self.transposed)

    @property
    def T(self) -> "NF4Tensor":
        return self.transpose()


def table_lookup(codes: ArrayLike, table: np.ndarray, *, gather: bool = False) -> Array:
    """`table[codes]` for a float32 `table` of $2^k$ entries and integer `codes` in range.

    With `gather=False`, a tree of selects on the codes' bits, lowest bit first: $k$ levels,
    $2^k - 1$ elementwise selects, no gather; with `gather=True`, indexing. Which is faster
    depends on the backend and the table: `gathers` says which the NF4 decoding uses.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.peft import NF4_VALUES, table_lookup
      >>> print(table_lookup(jnp.array([0, 7, 15]), NF4_VALUES))
      [-1.  0.  1.]
    """
    table = np.asarray(table, np.float32)
    bits = int(table.size).bit_length() - 1
    if table.ndim != 1 or table.size != 1 << bits:
        raise ValueError(f"table must be 1-D with a power-of-two size, got shape {table.shape}.")
    codes = jnp.asarray(codes).astype(jnp.int32)
    if gather:
        return jnp.asarray(table)[codes]
    values = [jnp.float32(value) for value in table]
    for bit in range(bits):
        high = ((codes >> bit) & 1) == 1
        values = [jnp.where(high, values[i + 1], values[i]) for i in range(0, len(values), 2)]
    return jnp.broadcast_to(values[0], codes.shape)


# Decoding a 4,096 x 14,336 NF4 weight by rows of blocks, in milliseconds, each lookup by
# select tree against by gather (docs/tpu.md, "NF4 on a TPU"):
#
#   TPU v5e, DYNAMIC_MAP by tree:  the 16 NF4_VALUES       3.6 / 3.0
#   TPU v5e, NF4_VALUES by tree:   the 256 DYNAMIC_MAP     3.6 / 11.0
#   CPU (2 cores), DYNAMIC_MAP by gather: NF4_VALUES       131 / 145
#   CPU (2 cores), NF4_VALUES by tree:    DYNAMIC_MAP      304 / 131
#
# A GPU, not measured, gathers both.
_GATHERS = {"tpu": {16: True, 256: False}, "cpu": {16: False, 256: True}}


def gathers(table: np.ndarray) -> bool:
    """Whether `NF4Tensor` decoding looks up `table` by gather (else by select tree) on
    JAX's default backend; chosen from the figures measured on each backend."""
    return _GATHERS.get(jax.default_backend(), {}).get(len(table), True)


def _blocks(flat: jax.Array, block_size: int) -> jax.Array:
    """`[..., n]` zero-padded to whole blocks and reshaped `[..., blocks, block_size]`."""
    n = flat.shape[-1]
    pad = -n % block_size
    flat = jnp.pad(flat, [(0, 0)] * (flat.ndim - 1) + [(0, pad)])
    return flat.reshape(*flat.shape[:-1], -1, block_size)


def pack_nibbles(codes: ArrayLike) -> UInt8[Array, "*S P"]:
    """Two 4-bit codes per byte along the last axis, the even element in the high nibble.

    An odd number of codes is padded with the code of 0.0 (7).

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.peft import pack_nibbles, unpack_nibbles
      >>> packed = pack_nibbles(jnp.array([1, 2, 15], jnp.uint8))
      >>> print(packed, unpack_nibbles(packed, 3))
      [ 18 247] [ 1  2 15]
    """
    codes = jnp.asarray(codes)
    if not jnp.issubdtype(codes.dtype, jnp.integer):
        raise TypeError(f"codes must be an integer array, got dtype {codes.dtype}.")
    codes = codes.astype(jnp.uint8)
    if codes.shape[-1] % 2:
        tail = jnp.full((*codes.shape[:-1], 1), NF4_ZERO_CODE, jnp.uint8)
        codes = jnp.concatenate([codes, tail], axis=-1)
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    return (pairs[..., 0] << 4) | pairs[..., 1]


def unpack_nibbles(packed: ArrayLike, size: int) -> UInt8[Array, "*S N"]:
    """The first `size` 4-bit codes of `pack_nibbles` output, along the last axis."""
    packed = jnp.asarray(packed)
    if packed.dtype != jnp.uint8:
        raise TypeError(f"packed must be a uint8 array, got dtype {packed.dtype}.")
    if not 0 <= size <= 2 * packed.shape[-1]:
        raise ValueError(f"size must lie in [0, {2 * packed.shape[-1]}], got {size}.")
    codes = jnp.stack([packed >> 4, packed & 15], axis=-1).reshape(*packed.shape[:-1], -1)
    return codes[..., :size]


def _nearest_codes(scaled: jax.Array, table: np.ndarray) -> jax.Array:
    """Index of the nearest entry of the ascending `table`; a tie goes to the lower one."""
    midpoints = jnp.asarray((table[:-1] + table[1:]) / np.float32(2))
    return jnp.searchsorted(midpoints, scaled, side="left").astype(jnp.uint8)


def _blockwise(flat: jax.Array, block_size: int, table: np.ndarray):
    """Codes `[..., n]` and absmax `[..., blocks]` of blockwise absmax quantisation."""
    n = flat.shape[-1]
    blocks = _blocks(flat, block_size)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    # A block of zeros scales to zeros (code of 0.0), not to 0 * inf.
    inverse = jnp.where(absmax > 0, 1.0 / jnp.where(absmax > 0, absmax, 1.0), 0.0)
    scaled = jnp.clip(blocks * inverse[..., None], -1.0, 1.0)
    codes = _nearest_codes(scaled, table).reshape(*flat.shape[:-1], -1)[..., :n]
    return codes, absmax


def nf4_quantize(
    x: Float[ArrayLike, "*S m n"],
    *,
    block_size: int = 64,
    double_quant: bool = True,
    absmax_block_size: int = 256,
    transpose: bool = False,
    matmul: str = "xla",
) -> NF4Tensor:
    r"""Quantise matrices to 4-bit NormalFloat, blockwise, as QLoRA and bitsandbytes do.

    For each block $b$ of `block_size` consecutive elements of the row-major flattened matrix,
    with $m_b = \max_{i \in b} |w_i|$ and the NF4 values $q_0 < \dots < q_{15}$:

    $$
    c_i = \arg\min_j \big| q_j - w_i / m_b \big|, \qquad \hat w_i = q_{c_i}\, m_b
    $$

    (a tie goes to the lower $j$), so $|\hat w_i - w_i| \le 0.1519036\, m_b$, half the widest gap
    of the table. With `double_quant` the $m_b$ are stored as 8-bit codes: their mean $\mu$ is
    subtracted and the rest quantised in blocks of `absmax_block_size` with the signed dynamic
    map (`signed_dynamic_map`), which brings the cost from 4.5 to 4.127 bits per parameter.
    Stacked matrices `[..., m, n]` are quantised matrix by matrix (one offset each).

    Args:
      x: `[..., m, n]` floating-point weights; `m n` need not be a multiple of the block.
      block_size: elements per block (bitsandbytes allows 32 to 4096; QLoRA uses 64).
      double_quant: quantise the block absmax values too (QLoRA's default).
      absmax_block_size: absmax values per block of the double quantisation.
      transpose: store `x`'s transpose `[n, m]` and stand for `x`: a JAX kernel `[in, out]`
        is then stored in the `[out, in]` layout of a bitsandbytes checkpoint.
      matmul: "xla" or "pallas", see `NF4Tensor`.

    Returns:
      An `NF4Tensor` standing for `x` (dequantising to `x`'s dtype).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from tunelib.peft import nf4_quantize, bits_per_parameter
      >>> w = jax.random.normal(jax.random.key(0), (1024, 512))
      >>> q = nf4_quantize(w)
      >>> err = jnp.abs(q.dequantize() - w).max()
      >>> print(q.shape, q.codes.shape, q.codes.dtype, bool(err < 0.16 * jnp.abs(w).max()))
      (1024, 512) (262144,) uint8 True
      >>> print(f"{bits_per_parameter(q):.3f}")
      4.127

    References:
      Dettmers et al., "QLoRA: Efficient Finetuning of Quantized LLMs", 2023,
      https://arxiv.org/abs/2305.14314.
    """
    x = v.float_array(x, "x")
    v.check_ndim(x, "x", at_least=2)
    for name, value in (("block_size", block_size), ("absmax_block_size", absmax_block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 2:
            raise ValueError(f"{name} must be an int >= 2, got {value!r}.")
    v.one_of(matmul, "matmul", ("xla", "pallas"))
    dtype = x.dtype
    if transpose:
        x = jnp.swapaxes(x, -1, -2)
    m, n = x.shape[-2:]
    if m * n == 0:
        raise ValueError(f"x must not be empty, got shape {x.shape}.")
    flat = x.astype(jnp.float32).reshape(*x.shape[:-2], m * n)
    codes, absmax = _blockwise(flat, block_size, NF4_VALUES)
    scale = offset = None
    if double_quant:
        offset = jnp.mean(absmax, axis=-1)
        absmax, scale = _blockwise(absmax - offset[..., None], absmax_block_size, DYNAMIC_MAP)
    return NF4Tensor(
        codes=pack_nibbles(codes),
        absmax=absmax,
        absmax_scale=scale,
        absmax_offset=offset,
        stored_shape=(m, n),
        transposed=transpose,
        value_dtype=jnp.dtype(dtype),
        block_size=block_size,
        absmax_block_size=absmax_block_size,
        matmul=matmul,
    )


def stored_bytes(tree) -> int:
    """Bytes of every array in `tree` as stored (codes, constants and dense leaves alike)."""
    leaves = jax.tree.leaves(tree)
    return sum(int(np.prod(x.shape)) * jnp.dtype(x.dtype).itemsize for x in leaves)


def bits_per_parameter(tree) -> float:
    """Stored bits per logical parameter of `tree`, measured from the arrays it holds.

    Quantised tensors (`NF4Tensor`, `Int8Tensor`) count the parameters they stand for and
    the bytes they store (codes and every block constant); other arrays count themselves.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.peft import nf4_quantize, bits_per_parameter
      >>> w = jnp.ones((64, 1024))
      >>> print(bits_per_parameter(nf4_quantize(w, double_quant=False)))
      4.5
      >>> print(bits_per_parameter(w.astype(jnp.bfloat16)))
      16.0
    """
    count = sum(
        math.prod(x.shape)
        for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, quax.ArrayValue))
    )
    return 8 * stored_bytes(tree) / count
