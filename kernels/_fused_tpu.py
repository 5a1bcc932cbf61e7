"""The fused log-prob kernels for TPUs (Pallas' Mosaic lowering).

A TPU core runs the grid in order, one step at a time, and Pallas pipelines the HBM <-> VMEM
copies of the blocks. So the reduction is a grid axis (the last, marked "arbitrary"): an output
or scratch block whose index does not change along that axis stays in VMEM and accumulates, is
initialised at the axis' first step (`pl.when`) and written back when the index changes. Each
step sees one `[block_n, H]` block of hidden states and one `[H, block_v]` block of the
unembedding: the whole hidden dimension, so that one matmul gives a finished tile of logits.

Kernels (`N`, `V` already padded to multiples of the blocks; `H` is never split):
  forward          grid (N / block_n, V / block_v); the online log-sum-exp stats are the outputs
                   and accumulate along the vocabulary axis.
  hidden_grad      grid (N / block_n, V / block_v); d hidden accumulates in a float32 scratch
                   along the vocabulary axis and is cast out at its last step.
  unembedding_grad grid (V / block_v, N / block_n); d unembedding accumulates in a float32
                   scratch along the token axis, d bias in its output.
"""

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tunelib.kernels import _fused_tiles as tiles

# The share of a core's VMEM the kernels may use. Mosaic's default scoped limit (16 MiB of
# a v5e core's 128 MiB) holds no blocks wider than 128 x 128 tokens x columns at H = 2304:
# the (block, 1) per-token columns alone take 128 lanes each.
VMEM_SHARE = 0.75


def _params(cfg: tiles.Config) -> pltpu.CompilerParams:
    capacity = None if cfg.interpret else pltpu.get_tpu_info().vmem_capacity_bytes
    return pltpu.CompilerParams(
        dimension_semantics=("parallel", "arbitrary"),
        vmem_limit_bytes=None if capacity is None else int(VMEM_SHARE * capacity),
    )


def _logits(h_ref, w_ref, b_ref, t_ref, j, cfg: tiles.Config, dtype):
    cols = tiles.columns(j, (cfg.block_n, cfg.block_v))
    hw = tiles.dot(h_ref[...], w_ref[...], tiles.NN, dtype)
    return tiles.scale_logits(hw, b_ref[...], t_ref[...], cols, cfg.vocab, cfg.softcap), cols


def _forward_kernel(h_ref, w_ref, b_ref, t_ref, y_ref, m_ref, s0_ref, s1_ref, zt_ref, *, cfg):
    j = pl.program_id(1)
    outs = (m_ref, s0_ref, s1_ref, zt_ref)

    @pl.when(j == 0)
    def _init():
        for ref, value in zip(outs, tiles.init_stats(cfg.block_n, m_ref.dtype), strict=True):
            ref[...] = value

    z, cols = _logits(h_ref, w_ref, b_ref, t_ref, j, cfg, m_ref.dtype)
    stats = tiles.Stats(*(ref[...] for ref in outs))
    stats = tiles.update_stats(stats, z, cols, y_ref[...], cfg.with_entropy)
    for ref, value in zip(outs, stats, strict=True):
        ref[...] = value


def _hidden_grad_kernel(*refs, cfg):
    h_ref, w_ref, b_ref, t_ref, *token_refs, dh_ref, zdz_ref, acc_ref = refs
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)
        zdz_ref[...] = jnp.zeros(zdz_ref.shape, zdz_ref.dtype)

    z, cols = _logits(h_ref, w_ref, b_ref, t_ref, j, cfg, acc_ref.dtype)
    per_token = [ref[...] for ref in token_refs]  # targets, lse, E_p[z], g, e
    dz, zdz = tiles.logits_cotangent(z, cols, *per_token, cfg.with_entropy)
    dz = tiles.input_cotangent(dz, z, t_ref[...], cfg.softcap).astype(h_ref.dtype)
    acc_ref[...] += tiles.dot(dz, w_ref[...], tiles.NT, acc_ref.dtype)
    zdz_ref[...] += zdz

    @pl.when(j == pl.num_programs(1) - 1)
    def _write():
        dh_ref[...] = acc_ref[...].astype(dh_ref.dtype)


def _unembedding_grad_kernel(*refs, cfg):
    h_ref, w_ref, b_ref, t_ref, *token_refs, dw_ref, db_ref, acc_ref = refs
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)
        db_ref[...] = jnp.zeros(db_ref.shape, db_ref.dtype)

    z, cols = _logits(h_ref, w_ref, b_ref, t_ref, j, cfg, acc_ref.dtype)
    per_token = [ref[...] for ref in token_refs]  # targets, lse, E_p[z], g, e
    dz, _ = tiles.logits_cotangent(z, cols, *per_token, cfg.with_entropy)
    dz = tiles.input_cotangent(dz, z, t_ref[...], cfg.softcap)
    acc_ref[...] += tiles.dot(h_ref[...], dz.astype(h_ref.dtype), tiles.TN, acc_ref.dtype)
    db_ref[...] += jnp.sum(dz, axis=0, keepdims=True)

    @pl.when(i == pl.num_programs(1) - 1)
    def _write():
        dw_ref[...] = acc_ref[...].astype(dw_ref.dtype)


def _specs(cfg: tiles.Config, hidden: int, tokens_first: bool):
    """Block specs of `(h, w, b, inv_t, *per-token columns)` for a grid over (tokens, vocab)
    or, when not `tokens_first`, over (vocab, tokens)."""

    def order(index_map):
        return index_map if tokens_first else (lambda j, i: index_map(i, j))

    token_block = order(lambda i, j: (i, 0))
    vocab_block = order(lambda i, j: (0, j))
    return [
        pl.BlockSpec((cfg.block_n, hidden), token_block),
        pl.BlockSpec((hidden, cfg.block_v), vocab_block),
        pl.BlockSpec((1, cfg.block_v), vocab_block),
        pl.BlockSpec((1, 1), lambda i, j: (0, 0)),
    ], pl.BlockSpec((cfg.block_n, 1), token_block)


def forward(h, w, b, inv_t, y, cfg: tiles.Config) -> tiles.Stats:
    n, hidden = h.shape
    column = jax.ShapeDtypeStruct((n, 1), inv_t.dtype)
    specs, per_token = _specs(cfg, hidden, tokens_first=True)
    stats = tiles.launch(
        _forward_kernel,
        "forward",
        cfg,
        _params(cfg),
        out_shape=[column] * 4,
        grid=(n // cfg.block_n, w.shape[1] // cfg.block_v),
        in_specs=[*specs, per_token],
        out_specs=[per_token] * 4,
    )(h, w, b, inv_t, y)
    return tiles.Stats(*stats)


def hidden_grad(h, w, b, inv_t, y, lse, mz, g, e, cfg: tiles.Config):
    """`(d hidden [N, H] in hidden's dtype, sum_v dz (z - lse) [N, 1])`."""
    n, hidden = h.shape
    dtype = inv_t.dtype
    specs, per_token = _specs(cfg, hidden, tokens_first=True)
    return tiles.launch(
        _hidden_grad_kernel,
        "hidden_grad",
        cfg,
        _params(cfg),
        out_shape=[jax.ShapeDtypeStruct(h.shape, h.dtype), jax.ShapeDtypeStruct((n, 1), dtype)],
        grid=(n // cfg.block_n, w.shape[1] // cfg.block_v),
        in_specs=[*specs] + [per_token] * 5,
        out_specs=[specs[0], per_token],
        scratch_shapes=[pltpu.VMEM((cfg.block_n, hidden), dtype)],
    )(h, w, b, inv_t, y, lse, mz, g, e)


def unembedding_grad(h, w, b, inv_t, y, lse, mz, g, e, cfg: tiles.Config):
    """`(d unembedding [H, V] in its dtype, d bias [1, V] in the accumulation dtype)`."""
    hidden, vocab = w.shape
    dtype = inv_t.dtype
    specs, per_token = _specs(cfg, hidden, tokens_first=False)
    return tiles.launch(
        _unembedding_grad_kernel,
        "unembedding_grad",
        cfg,
        _params(cfg),
        out_shape=[jax.ShapeDtypeStruct(w.shape, w.dtype), jax.ShapeDtypeStruct((1, vocab), dtype)],
        grid=(vocab // cfg.block_v, h.shape[0] // cfg.block_n),
        in_specs=[*specs] + [per_token] * 5,
        out_specs=[specs[1], specs[2]],
        scratch_shapes=[pltpu.VMEM((hidden, cfg.block_v), dtype)],
    )(h, w, b, inv_t, y, lse, mz, g, e)
