r"""Dequantise-and-multiply Pallas kernels for NF4 weights (QLoRA's frozen base).

`y = x @ W^T` for `x [M, K]` and an NF4 weight `W [N, K]` stored as packed codes `[N, K/2]`
(two per byte, even element high) and float32 block absmax `[N, K / block]`, with each row made
of whole blocks. The dense `W` never exists in memory: every program loads a tile of codes,
turns it into values in registers and multiplies.

The even and odd elements of a row sit in the high and low nibbles of the same bytes, so the
kernels never interleave them: with $x_e$, $x_o$ the even and odd columns of $x$ and $W_e$,
$W_o$ those of $W$,

$$
y = x_e W_e^\top + x_o W_o^\top, \qquad
\partial x_e = g\, W_e, \quad \partial x_o = g\, W_o ,
$$

and the strided split of $x$ (and the interleave of $\partial x$) is done outside, on the
activations. Kernels (`M`, `N` padded to the blocks; `half = block / 2`):

  forward   grid (M / block_m, N / block_n); loop over the K / block quantisation blocks:
            decode `[block_n, half]` high and low nibbles, scale by the block's absmax,
            accumulate two `[block_m, block_n]` products in float32.
  input_grad grid (M / block_m, K / block); loop over N / block_n tiles: decode the same
            tiles, accumulate `g [block_m, block_n] @ W_e`, `@ W_o` into `[block_m, half]`.

Lowered with Pallas' Triton backend on GPUs (both grid axes run in parallel; no atomics) and
run by the Pallas interpreter on CPU; on a TPU, which has no lowering of it, it is refused in
one line (the pure-JAX product runs there).
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jax.typing import ArrayLike, DTypeLike
from jaxtyping import Array, Float, UInt8

from tunelib import _validation as v


class _Config(NamedTuple):
    table: tuple[float, ...]  # the 16 code values
    block_size: int  # elements per quantisation block along K
    block_m: int
    block_n: int
    x_dtype: str
    out_dtype: str
    interpret: bool


def _decode(codes: jax.Array, table: tuple[float, ...]) -> jax.Array:
    """Code values (float32) of integer codes, by selects: no gather inside the kernel."""
    out = jnp.zeros(codes.shape, jnp.float32)
    for i, value in enumerate(table):
        out = jnp.where(codes == i, jnp.float32(value), out)
    return out


def _weight_tile(codes_ref, absmax_ref, rows, kb, cfg: _Config, dtype):
    """The even and odd columns `[rows, half]` of quantisation block `kb`, in `dtype`."""
    half = cfg.block_size // 2
    packed = codes_ref[rows, pl.ds(kb * half, half)].astype(jnp.int32)
    scale = absmax_ref[rows, pl.ds(kb, 1)]
    even = (_decode(packed >> 4, cfg.table) * scale).astype(dtype)
    odd = (_decode(packed & 15, cfg.table) * scale).astype(dtype)
    return even, odd


def _dot(a, b, contract):
    precision = lax.Precision.HIGHEST if a.dtype.itemsize >= 4 else lax.Precision.DEFAULT
    numbers = (((contract[0],), (contract[1],)), ((), ()))
    return lax.dot_general(a, b, numbers, precision=precision, preferred_element_type=jnp.float32)


def _forward_kernel(xe_ref, xo_ref, codes_ref, absmax_ref, y_ref, *, cfg: _Config):
    half = cfg.block_size // 2
    dtype = xe_ref.dtype

    def block(kb, acc):
        ks = pl.ds(kb * half, half)
        even, odd = _weight_tile(codes_ref, absmax_ref, slice(None), kb, cfg, dtype)
        acc = acc + _dot(xe_ref[:, ks], even, (1, 1))
        return acc + _dot(xo_ref[:, ks], odd, (1, 1))

    n_blocks = absmax_ref.shape[1]
    acc = lax.fori_loop(0, n_blocks, block, jnp.zeros((cfg.block_m, cfg.block_n), jnp.float32))
    y_ref[...] = acc.astype(y_ref.dtype)


def _input_grad_kernel(g_ref, codes_ref, absmax_ref, dxe_ref, dxo_ref, *, cfg: _Config):
    half = cfg.block_size // 2
    kb = pl.program_id(1)
    dtype = g_ref.dtype

    def tile(j, acc):
        rows = pl.ds(j * cfg.block_n, cfg.block_n)
        even, odd = _weight_tile(codes_ref, absmax_ref, rows, kb, cfg, dtype)
        g = g_ref[:, rows]
        return acc[0] + _dot(g, even, (1, 0)), acc[1] + _dot(g, odd, (1, 0))

    n_tiles = codes_ref.shape[0] // cfg.block_n
    zeros = jnp.zeros((cfg.block_m, half), jnp.float32)
    dxe, dxo = lax.fori_loop(0, n_tiles, tile, (zeros, zeros))
    dxe_ref[...] = dxe.astype(dxe_ref.dtype)
    dxo_ref[...] = dxo.astype(dxo_ref.dtype)


def _params() -> pltriton.CompilerParams:
    return pltriton.CompilerParams(num_warps=4, num_stages=2)


def _forward(xe, xo, codes, absmax, cfg: _Config):
    m, k_half = xe.shape
    n = codes.shape[0]
    return pl.pallas_call(
        functools.partial(_forward_kernel, cfg=cfg),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.dtype(cfg.out_dtype)),
        grid=(m // cfg.block_m, n // cfg.block_n),
        in_specs=[
            pl.BlockSpec((cfg.block_m, k_half), lambda i, j: (i, 0)),
            pl.BlockSpec((cfg.block_m, k_half), lambda i, j: (i, 0)),
            pl.BlockSpec((cfg.block_n, k_half), lambda i, j: (j, 0)),
            pl.BlockSpec((cfg.block_n, absmax.shape[1]), lambda i, j: (j, 0)),
        ],
        out_specs=pl.BlockSpec((cfg.block_m, cfg.block_n), lambda i, j: (i, j)),
        compiler_params=_params(),
        interpret=cfg.interpret,
        name="nf4_matmul_forward",
    )(xe, xo, codes, absmax)


def _input_grad(g, codes, absmax, dtype, cfg: _Config):
    m, n = g.shape
    half = cfg.block_size // 2
    k_half = codes.shape[1]
    out = jax.ShapeDtypeStruct((m, k_half), dtype)
    return pl.pallas_call(
        functools.partial(_input_grad_kernel, cfg=cfg),
        out_shape=[out, out],
        grid=(m // cfg.block_m, absmax.shape[1]),
        in_specs=[
            pl.BlockSpec((cfg.block_m, n), lambda i, kb: (i, 0)),
            pl.BlockSpec(codes.shape, lambda i, kb: (0, 0)),
            pl.BlockSpec(absmax.shape, lambda i, kb: (0, 0)),
        ],
        out_specs=[pl.BlockSpec((cfg.block_m, half), lambda i, kb: (i, kb))] * 2,
        compiler_params=_params(),
        interpret=cfg.interpret,
        name="nf4_matmul_input_grad",
    )(g, codes, absmax)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _matmul(x, codes, absmax, cfg: _Config):
    return _forward(x[:, 0::2], x[:, 1::2], codes, absmax, cfg)


def _matmul_fwd(x, codes, absmax, cfg: _Config):
    return _matmul(x, codes, absmax, cfg), (codes, absmax)


def _matmul_bwd(cfg: _Config, residuals, g):
    codes, absmax = residuals
    dtype = jnp.dtype(cfg.x_dtype)
    dxe, dxo = _input_grad(g.astype(dtype), codes, absmax, dtype, cfg)
    dx = jnp.stack([dxe, dxo], axis=-1).reshape(g.shape[0], -1)
    return dx, None, None  # the weight is frozen


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _round_up(x: int, unit: int) -> int:
    return -(-x // unit) * unit


def nf4_matmul_pallas(
    x: Float[ArrayLike, "M K"],
    codes: UInt8[ArrayLike, "N K2"],
    absmax: Float[ArrayLike, "N B"],
    *,
    table: tuple[float, ...],
    block_size: int = 64,
    out_dtype: DTypeLike | None = None,
    block_m: int = 32,
    block_n: int = 64,
    interpret: bool | None = None,
) -> Float[Array, "M N"]:
    r"""`x @ W^T` for an NF4 weight `W [N, K]` given by its packed codes, in Pallas kernels.

    $$
    W_{nk} = q_{c_{nk}}\, m_{n, \lfloor k / \text{block} \rfloor}, \qquad
    y_{mn} = \sum_k x_{mk} W_{nk}
    $$

    with code values $q$ = `table`, codes $c$ unpacked from `codes` (element $2j$ in the high
    nibble of byte $j$) and block absmax $m$ = `absmax`: the product with
    `tunelib.peft.NF4Tensor.dequantize()` of a weight whose rows are whole blocks, which
    `tunelib.peft` calls for `NF4Tensor`s built with `matmul="pallas"`. Differentiable in `x`
    (the weight is frozen): the backward kernel decodes the tiles again, so no dequantised
    weight is saved. The products accumulate in float32.

    Args:
      x: `[M, K]` activations.
      codes: `[N, K / 2]` uint8 packed codes.
      absmax: `[N, K / block_size]` float32 absmax of every block (double-quantised values
        dequantised by the caller).
      table: the 16 code values (static).
      block_size: elements per quantisation block, even; `K` must be a multiple.
      out_dtype: the output dtype (default: `x`'s).
      block_m: rows of `x` per program (a power of two >= 16 on GPU).
      block_n: rows of `W` per program (a power of two >= 16 on GPU).
      interpret: run in the Pallas interpreter; None means on CPU only.

    Returns:
      `[M, N]` in `out_dtype`.

    Examples:
      >>> import jax.numpy as jnp
      >>> from tunelib.kernels import nf4_matmul_pallas
      >>> table = tuple(float(i) for i in range(16))           # code i means the value i
      >>> codes = jnp.full((2, 32), 0x12, jnp.uint8)            # a row of 1, 2, 1, 2, ...
      >>> absmax = jnp.array([[1.0], [0.5]])
      >>> y = nf4_matmul_pallas(jnp.ones((1, 64)), codes, absmax, table=table)
      >>> print(y)
      [[96. 48.]]
    """
    x = v.float_array(x, "x")
    codes = jnp.asarray(codes)
    absmax = v.float_array(absmax, "absmax").astype(jnp.float32)
    if x.ndim != 2 or codes.ndim != 2 or absmax.ndim != 2:
        raise ValueError(
            f"x, codes and absmax must be 2-D, got {x.shape}, {codes.shape}, {absmax.shape}."
        )
    if codes.dtype != jnp.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}.")
    m, k = x.shape
    n = codes.shape[0]
    if block_size % 2 or k % block_size:
        raise ValueError(
            f"block_size must be even and divide K = {k} (x's last axis), got {block_size}."
        )
    if codes.shape != (n, k // 2) or absmax.shape != (n, k // block_size):
        raise ValueError(
            f"codes must have shape {(n, k // 2)} and absmax {(n, k // block_size)} for x "
            f"{x.shape} and {n} rows, got {codes.shape} and {absmax.shape}."
        )
    if len(table) != 16:
        raise ValueError(f"table must hold 16 code values, got {len(table)}.")
    interpret = jax.default_backend() == "cpu" if interpret is None else interpret
    if not interpret and jax.default_backend() == "tpu":
        raise ValueError(
            "nf4_matmul_pallas has a Triton (GPU) lowering only; on a TPU use the pure-JAX "
            "product (tunelib.peft's matmul='xla'), or interpret=True to check it."
        )
    cfg = _Config(
        tuple(float(t) for t in table),
        block_size,
        block_m,
        block_n,
        x.dtype.name,
        jnp.dtype(out_dtype or x.dtype).name,
        interpret,
    )
    m_pad, n_pad = _round_up(max(m, 1), block_m), _round_up(n, block_n)
    x_pad = jnp.pad(x, [(0, m_pad - m), (0, 0)])
    codes_pad = jnp.pad(codes, [(0, n_pad - n), (0, 0)])
    absmax_pad = jnp.pad(absmax, [(0, n_pad - n), (0, 0)])
    return _matmul(x_pad, codes_pad, absmax_pad, cfg)[:m, :n]
