"""The fused log-prob kernels for GPUs (Pallas' Triton lowering).

Every grid axis of a Triton kernel runs in parallel, so nothing can be accumulated across grid
steps: each program owns whole output rows (or columns) and loops over the other axis itself
with `lax.fori_loop`. The hidden dimension is consumed in chunks of `block_h` inside each
matmul, so a program holds only `[block_n, block_v]` logits and `[block_n, block_h]` /
`[block_h, block_v]` operands in registers; arrays that a program reads across its whole
loop stay in global memory and are indexed with `pl.ds`.

Kernels (`N`, `H`, `V` already padded to multiples of the blocks):
  forward          grid N / block_n; loop over vocabulary tiles -> online log-sum-exp stats.
  hidden_grad      grid N / block_n; loop over vocabulary tiles: recompute z, dz, add
                   dz W_tile^T to the program's rows of d hidden.
  unembedding_grad grid V / block_v; loop over token blocks: recompute z, dz, add
                   h_block^T dz to the program's columns of d unembedding (and d bias).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from tunelib.kernels import _fused_tiles as tiles


def _params() -> pltriton.CompilerParams:
    return pltriton.CompilerParams(num_warps=4, num_stages=2)


def _hw(h_ref, rows, w_ref, cols, cfg: tiles.Config, dtype) -> jax.Array:
    """`h[rows] @ W[:, cols]` as `[block_n, block_v]`, summed over chunks of the hidden axis."""
    n_chunks = h_ref.shape[1] // cfg.block_h

    def chunk(k, acc):
        hs = pl.ds(k * cfg.block_h, cfg.block_h)
        return acc + tiles.dot(h_ref[rows, hs], w_ref[hs, cols], tiles.NN, dtype)

    return lax.fori_loop(0, n_chunks, chunk, jnp.zeros((cfg.block_n, cfg.block_v), dtype))


def _forward_kernel(h_ref, w_ref, b_ref, t_ref, y_ref, m_ref, s0_ref, s1_ref, zt_ref, *, cfg):
    dtype = m_ref.dtype
    inv_t = t_ref[...]
    targets = y_ref[...]
    shape = (cfg.block_n, cfg.block_v)

    def vocab_tile(j, stats):
        vs = pl.ds(j * cfg.block_v, cfg.block_v)
        cols = tiles.columns(j, shape)
        hw = _hw(h_ref, slice(None), w_ref, vs, cfg, dtype)
        z = tiles.scale_logits(hw, b_ref[:, vs], inv_t, cols, cfg.vocab, cfg.softcap)
        return tiles.update_stats(stats, z, cols, targets, cfg.with_entropy)

    n_tiles = w_ref.shape[1] // cfg.block_v
    stats = lax.fori_loop(0, n_tiles, vocab_tile, tiles.init_stats(cfg.block_n, dtype))
    for ref, value in zip((m_ref, s0_ref, s1_ref, zt_ref), stats, strict=True):
        ref[...] = value


def _hidden_grad_kernel(
    h_ref, w_ref, b_ref, t_ref, y_ref, lse_ref, mz_ref, g_ref, e_ref, dh_ref, zdz_ref, *, cfg
):
    dtype = zdz_ref.dtype
    inv_t = t_ref[...]
    per_token = [r[...] for r in (y_ref, lse_ref, mz_ref, g_ref, e_ref)]
    shape = (cfg.block_n, cfg.block_v)
    n_chunks = h_ref.shape[1] // cfg.block_h

    def zero(k, _):
        dh_ref[:, pl.ds(k * cfg.block_h, cfg.block_h)] = jnp.zeros(
            (cfg.block_n, cfg.block_h), dh_ref.dtype
        )

    lax.fori_loop(0, n_chunks, zero, None)

    def vocab_tile(j, zdz):
        vs = pl.ds(j * cfg.block_v, cfg.block_v)
        cols = tiles.columns(j, shape)
        hw = _hw(h_ref, slice(None), w_ref, vs, cfg, dtype)
        z = tiles.scale_logits(hw, b_ref[:, vs], inv_t, cols, cfg.vocab, cfg.softcap)
        dz, tile_zdz = tiles.logits_cotangent(z, cols, *per_token, cfg.with_entropy)
        dz = tiles.input_cotangent(dz, z, inv_t, cfg.softcap).astype(h_ref.dtype)

        def chunk(k, _):
            hs = pl.ds(k * cfg.block_h, cfg.block_h)
            dh_ref[:, hs] += tiles.dot(dz, w_ref[hs, vs], tiles.NT, dtype)

        lax.fori_loop(0, n_chunks, chunk, None)
        return zdz + tile_zdz

    n_tiles = w_ref.shape[1] // cfg.block_v
    zdz_ref[...] = lax.fori_loop(0, n_tiles, vocab_tile, jnp.zeros((cfg.block_n, 1), dtype))


def _unembedding_grad_kernel(
    h_ref, w_ref, b_ref, t_ref, y_ref, lse_ref, mz_ref, g_ref, e_ref, dw_ref, db_ref, *, cfg
):
    dtype = db_ref.dtype
    inv_t = t_ref[...]
    bias = b_ref[...]
    j = pl.program_id(0)
    shape = (cfg.block_n, cfg.block_v)
    cols = tiles.columns(j, shape)
    n_chunks = h_ref.shape[1] // cfg.block_h

    def zero(k, _):
        dw_ref[pl.ds(k * cfg.block_h, cfg.block_h), :] = jnp.zeros(
            (cfg.block_h, cfg.block_v), dw_ref.dtype
        )

    lax.fori_loop(0, n_chunks, zero, None)

    def token_block(i, db):
        rows = pl.ds(i * cfg.block_n, cfg.block_n)
        per_token = [r[rows, :] for r in (y_ref, lse_ref, mz_ref, g_ref, e_ref)]
        hw = _hw(h_ref, rows, w_ref, slice(None), cfg, dtype)
        z = tiles.scale_logits(hw, bias, inv_t, cols, cfg.vocab, cfg.softcap)
        dz, _ = tiles.logits_cotangent(z, cols, *per_token, cfg.with_entropy)
        dz = tiles.input_cotangent(dz, z, inv_t, cfg.softcap)
        low = dz.astype(h_ref.dtype)

        def chunk(k, _):
            hs = pl.ds(k * cfg.block_h, cfg.block_h)
            dw_ref[hs, :] += tiles.dot(h_ref[rows, hs], low, tiles.TN, dtype)

        lax.fori_loop(0, n_chunks, chunk, None)
        return db + jnp.sum(dz, axis=0, keepdims=True)

    n_blocks = h_ref.shape[0] // cfg.block_n
    db_ref[...] = lax.fori_loop(0, n_blocks, token_block, jnp.zeros((1, cfg.block_v), dtype))


def _token_spec(cfg: tiles.Config, width: int) -> pl.BlockSpec:
    return pl.BlockSpec((cfg.block_n, width), lambda i: (i, 0))


def _whole(x: jax.Array | np.ndarray) -> pl.BlockSpec:
    return pl.BlockSpec(x.shape, lambda i: (0,) * x.ndim)


def forward(h, w, b, inv_t, y, cfg: tiles.Config) -> tiles.Stats:
    n, hidden = h.shape
    dtype = inv_t.dtype
    column = jax.ShapeDtypeStruct((n, 1), dtype)
    stats = tiles.launch(
        _forward_kernel,
        "forward",
        cfg,
        _params(),
        out_shape=[column] * 4,
        grid=(n // cfg.block_n,),
        in_specs=[
            _token_spec(cfg, hidden),
            _whole(w),
            _whole(b),
            _whole(inv_t),
            _token_spec(cfg, 1),
        ],
        out_specs=[_token_spec(cfg, 1)] * 4,
    )(h, w, b, inv_t, y)
    return tiles.Stats(*stats)


def hidden_grad(h, w, b, inv_t, y, lse, mz, g, e, cfg: tiles.Config):
    """`(d hidden [N, H] in the accumulation dtype, sum_v dz (z - lse) [N, 1])`."""
    n, hidden = h.shape
    dtype = inv_t.dtype
    column = _token_spec(cfg, 1)
    return tiles.launch(
        _hidden_grad_kernel,
        "hidden_grad",
        cfg,
        _params(),
        out_shape=[jax.ShapeDtypeStruct((n, hidden), dtype), jax.ShapeDtypeStruct((n, 1), dtype)],
        grid=(n // cfg.block_n,),
        in_specs=[_token_spec(cfg, hidden), _whole(w), _whole(b), _whole(inv_t)] + [column] * 5,
        out_specs=[_token_spec(cfg, hidden), column],
    )(h, w, b, inv_t, y, lse, mz, g, e)


def unembedding_grad(h, w, b, inv_t, y, lse, mz, g, e, cfg: tiles.Config):
    """`(d unembedding [H, V], d bias [1, V])`, both in the accumulation dtype."""
    hidden, vocab = w.shape
    dtype = inv_t.dtype
    per_token = [_whole(x) for x in (y, lse, mz, g, e)]
    return tiles.launch(
        _unembedding_grad_kernel,
        "unembedding_grad",
        cfg,
        _params(),
        out_shape=[
            jax.ShapeDtypeStruct((hidden, vocab), dtype),
            jax.ShapeDtypeStruct((1, vocab), dtype),
        ],
        grid=(vocab // cfg.block_v,),
        in_specs=[
            _whole(h),
            pl.BlockSpec((hidden, cfg.block_v), lambda j: (0, j)),
            pl.BlockSpec((1, cfg.block_v), lambda j: (0, j)),
            _whole(inv_t),
            *per_token,
        ],
        out_specs=[
            pl.BlockSpec((hidden, cfg.block_v), lambda j: (0, j)),
            pl.BlockSpec((1, cfg.block_v), lambda j: (0, j)),
        ],
    )(h, w, b, inv_t, y, lse, mz, g, e)
