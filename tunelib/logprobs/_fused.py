r"""Per-token log-probs straight from hidden states: the fused, chunked unembedding.

Almost every post-training loss touches the vocabulary only through the log-probability of the
target token (and sometimes the entropy). This module computes them from hidden states `[N, H]`
and the unembedding `[H, V]` one vocabulary tile at a time, so the `[N, V]` logits never exist,
with a custom VJP whose cotangents are per token: any loss on `[B, T]` log-probs gets the
memory saving.
"""

import functools
from typing import Literal

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike
from jaxtyping import Array, Float, Int

from tunelib import _validation as v
from tunelib._typing import Mask, Scalar
from tunelib.logprobs._tiles import (
    cap_slope,
    default_chunk_size,
    tile_logits,
    tile_loop,
    tiles,
    varying_zero,
    vocab_tile,
    write_tiles,
)

Implementation = Literal["auto", "chunked", "pallas", "naive"]
IMPLEMENTATIONS: tuple[str, ...] = Implementation.__args__


def _target_logit(z, hit):
    r"""The logit of each row's target from a tile of `[N, chunk]` logits `z`, where `hit` is
    True at the target's column (if the tile holds it; 0 where it does not).

    Read out of the very logits the log-sum-exp sums, so that $\log \pi(y) = z_y -
    \mathrm{lse}$ holds with one rounding of $z_y$: a target logit from a second, differently
    ordered product differs from the one inside the log-sum-exp by the float32 rounding of an
    `H`-term sum, which a likely token's log-prob would carry whole.
    """
    return jnp.sum(jnp.where(hit, z, 0.0), axis=-1)


def _vocab_offset(vocab_local: int, axis: str | None) -> int | jax.Array:
    return 0 if axis is None else lax.axis_index(axis) * vocab_local


def _tile_stats(z, owned, with_entropy):
    """Max, sum of exp(z - max) and sum of exp(z - max) z over the owned columns of a tile."""
    z = jnp.where(owned, z, -jnp.inf)
    m = jnp.max(z, axis=-1)
    e = jnp.exp(z - m[:, None])
    a = jnp.sum(jnp.where(owned, e * z, 0.0), axis=-1) if with_entropy else jnp.zeros_like(m)
    return m, jnp.sum(e, axis=-1), a


def _merge_stats(left, right):
    """Online log-sum-exp: the statistics of two sets of columns, around their common max."""
    (m1, s1, a1), (m2, s2, a2) = left, right
    m = jnp.maximum(m1, m2)
    r1, r2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    return m, s1 * r1 + s2 * r2, a1 * r1 + a2 * r2


def _finish(stats, target_z, axis):
    """logps, lse and E_p[z] from the statistics, combined across vocabulary shards."""
    m, s, a = stats
    if axis is not None:
        # The shift is any common constant; it carries no gradient (pmax has no derivative).
        m_all = lax.pmax(lax.stop_gradient(m), axis)
        rescale = jnp.exp(m - m_all)
        m, s, a = m_all, lax.psum(s * rescale, axis), lax.psum(a * rescale, axis)
        target_z = lax.psum(target_z, axis)
    log_s = jnp.log(s)
    # The max off first, as `jax.nn.log_softmax` does: a likely token's log-prob stays exact
    # to the rounding of log s instead of that of the logit's size.
    return (target_z - m) - log_s, m + log_s, a / s


def _forward(h, w, b, targets, tau, chunk, with_entropy, axis, softcap):
    """logps, lse and E_p[z] per token, streaming vocabulary tiles with an online log-sum-exp."""
    vocab = w.shape[1]
    dtype = v.compute_dtype(h.dtype, w.dtype)
    tau = tau.astype(dtype)
    chunk, n_tiles = tiles(vocab, chunk)

    local = targets - _vocab_offset(vocab, axis)  # the targets' columns in this shard

    def stats(index, w):
        start, w_tile, b_tile, owned = vocab_tile(w, b, index, chunk)
        z = tile_logits(h, w_tile, b_tile, tau, dtype, softcap)
        hit = owned & (start + jnp.arange(chunk) == local[:, None])
        return _tile_stats(z, owned, with_entropy), _target_logit(z, hit)

    def add_tile(index, acc, w):
        tile_stats, tile_target = stats(index, w)
        return _merge_stats(acc[0], tile_stats), acc[1] + tile_target

    # The first tile seeds the loop, so the carry has the type (and, under shard_map, the
    # device variance) of the tiles.
    total, target_z = tile_loop(1, n_tiles, add_tile, stats(0, w), (w,))
    return _finish(total, target_z, axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _chunked(h, w, b, targets, tau, chunk, with_entropy, axis, softcap):
    logps, lse, expected_z = _forward(h, w, b, targets, tau, chunk, with_entropy, axis, softcap)
    return logps, lse - expected_z


def _chunked_fwd(h, w, b, targets, tau, chunk, with_entropy, axis, softcap):
    logps, lse, expected_z = _forward(h, w, b, targets, tau, chunk, with_entropy, axis, softcap)
    residuals = (h, w, b, targets, tau, lse, expected_z)
    return (logps, lse - expected_z), residuals


def _chunked_bwd(chunk, with_entropy, axis, softcap, residuals, cotangents):
    h, w, b, targets, tau, lse, expected_z = residuals
    g, e = cotangents
    vocab = w.shape[1]
    dtype = v.compute_dtype(h.dtype, w.dtype)
    tau_c = tau.astype(dtype)
    chunk, n_tiles = tiles(vocab, chunk)
    g = g.astype(dtype)
    e = e.astype(dtype) if with_entropy else None
    local = targets - _vocab_offset(vocab, axis)  # the targets' columns in this shard

    def tile_grads(index, w, h_t):
        start, w_tile, b_tile, owned = vocab_tile(w, b, index, chunk)
        z = tile_logits(h, w_tile, b_tile, tau_c, dtype, softcap)
        p = jnp.where(owned, jnp.exp(z - lse[:, None]), 0.0)
        hit = owned & (start + jnp.arange(chunk) == local[:, None])
        dz = g[:, None] * (hit - p)
        if with_entropy:
            dz = dz - e[:, None] * p * (z - expected_z[:, None])
        z_dz = jnp.sum(dz * z)  # for the temperature's gradient
        dz = dz / tau_c * cap_slope(z, tau_c, softcap)  # d/d(h W + b)
        dh = jnp.matmul(dz, w_tile.T.astype(dtype), preferred_element_type=dtype)
        dw_tile = jnp.matmul(h_t, dz, preferred_element_type=dtype)
        return start, dh, dw_tile.astype(w.dtype), jnp.sum(dz, axis=0), z_dz

    def tile(index, carry, w, h_t):
        dh, db, z_dz = carry
        start, tile_dh, dw_tile, db_tile, tile_z_dz = tile_grads(index, w, h_t)
        if db is not None:  # disjoint columns too, written once
            db = lax.dynamic_update_slice_in_dim(db, db_tile, start, axis=0)
        return (dh + tile_dh, db, z_dz + tile_z_dz), start, dw_tile

    # Each tile owns a disjoint slice of the unembedding's gradient and writes it once, in the
    # unembedding's dtype (`write_tiles`). d hidden and the temperature's gradient accumulate
    # over the tiles in `dtype`.
    zero = varying_zero(h, w, b, targets, tau, lse, expected_z, g, e)
    init = (
        jnp.zeros(h.shape, dtype) + zero.astype(dtype),
        None if b is None else jnp.zeros(b.shape, dtype) + zero[0].astype(dtype),
        zero[0, 0].astype(dtype),
    )
    (dh, db, z_dz), dw = write_tiles(
        tile, init, (w, h.T.astype(dtype)), n_tiles=n_tiles, chunk=chunk, shape=w.shape,
        dtype=w.dtype, zero=zero,
    )  # fmt: skip
    # z = logits / tau, so d/d tau = -sum(dz * z) / tau over every logit.
    d_tau = -z_dz / tau_c
    dh, dw = _sum_over_broadcast_axes(dh, h), _sum_over_broadcast_axes(dw, w)
    db = None if db is None else _sum_over_broadcast_axes(db, b).astype(b.dtype)
    d_tau = _sum_over_broadcast_axes(d_tau, tau)
    return dh.astype(h.dtype), dw, db, None, d_tau.astype(tau.dtype)


def _sum_over_broadcast_axes(cotangent: jax.Array, primal: ArrayLike) -> jax.Array:
    """Under `shard_map`, sum a cotangent over the mesh axes its primal is replicated across.

    Each device's tiles contribute a part of the gradient of an input that all devices of an
    axis share (the hidden states across a vocabulary axis, the unembedding across a data
    axis); the transpose of that sharing is a sum. Outside `shard_map` nothing varies.
    """
    shared = tuple(sorted(_varying_axes(cotangent) - _varying_axes(primal)))
    return lax.psum(cotangent, shared) if shared else cotangent


def _varying_axes(x: ArrayLike) -> frozenset[str]:
    """The manual mesh axes `x` varies over (`manual_axis_type`, formerly `vma`)."""
    aval = jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


def _naive(h, w, b, targets, tau, with_entropy, axis, softcap):
    """Materialised logits: the reference path, and the baseline the benchmarks compare with."""
    dtype = v.compute_dtype(h.dtype, w.dtype)
    tau = tau.astype(dtype)
    z = tile_logits(h, w, b, tau, dtype, softcap)
    local = targets - _vocab_offset(w.shape[1], axis)
    hit = jnp.arange(w.shape[1]) == local[:, None]
    if axis is None and not with_entropy:  # the plain path: log-softmax and a gather
        logps = _target_logit(jax.nn.log_softmax(z, axis=-1), hit)
        return logps, jnp.zeros_like(logps)
    target_z = _target_logit(z, hit)
    stats = _tile_stats(z, jnp.ones(z.shape[-1], bool), with_entropy)
    logps, lse, expected_z = _finish(stats, target_z, axis)
    return logps, lse - expected_z


def _resolve(implementation: str) -> str:
    v.one_of(implementation, "implementation", IMPLEMENTATIONS)
    if implementation != "auto":
        return implementation
    # The fastest implementation at bounded memory, measured per backend on the Gemma-2-2B
    # head with gradients (benchmarks/README.md): on a TPU v5e chunked 238-242 ms against the
    # Mosaic kernel's 253-268 ms at its best blocks and 458 ms at the former 128 x 128 ones;
    # on an H200 chunked 176 ms against the Triton kernel's 554 ms; the CPU has no kernel.
    # Both take a fraction of the materialised path's memory, which is faster (195 ms on the
    # v5e, 8.4 GB of temporaries against chunked's 76 MB) and is never chosen by "auto".
    return "chunked"


def fused_token_logps(
    hidden: Float[ArrayLike, "*B H"],
    unembedding: Float[ArrayLike, "H V"],
    targets: Int[ArrayLike, "*B"],
    *,
    bias: Float[ArrayLike, " V"] | None = None,
    temperature: Scalar = 1.0,
    softcap: float | None = None,
    with_entropy: bool = False,
    where: Mask[ArrayLike, "*B"] | None = None,
    chunk_size: int | None = None,
    implementation: Implementation = "auto",
    vocab_axis: str | None = None,
) -> Float[Array, "*B"] | tuple[Float[Array, "*B"], Float[Array, "*B"]]:
    r"""Target log-probs (and entropy) from hidden states, without forming `[..., V]` logits.

    $$
    z_{n} = \mathrm{cap}(h_n W + b) / \tau, \qquad
    \log \pi(y_n) = z_{n, y_n} - \log \sum_v e^{z_{n,v}}, \qquad
    H_n = \log \sum_v e^{z_{n,v}} - \sum_v \pi_{n,v} z_{n,v}
    $$

    with hidden states $h$ = `hidden`, unembedding $W$ = `unembedding` (`[H, V]`, for a
    decoder `model.unembedding()`), bias $b$ = `bias`, targets $y$ = `targets` and temperature
    $\tau$ = `temperature`, and $\mathrm{cap}(l) = c \tanh(l / c)$ with $c$ = `softcap` (the
    final-logit soft-capping of Gemma 2 and 4, applied before the temperature as
    `transformers` does; the identity when None). The values equal `token_logps` /
    `token_entropy` of the materialised logits; the memory does not grow with $N \times V$.

    The ``"chunked"`` implementation streams the vocabulary in tiles of `chunk_size` columns
    with an online log-sum-exp, and its custom VJP recomputes each tile in the backward pass:
    $8NHV$ flops for values and gradients (against $6NHV$ when the logits are kept), and only
    per-token quantities saved between the passes. Gradients flow to `hidden`, `unembedding`,
    `bias` and `temperature`, accumulated in float32; the cotangents are per token, so any
    loss built on the returned log-probs (SFT, DPO, GRPO, ...) gets the saving.

    Args:
      hidden: `[..., H]` hidden states, any float dtype (matmuls accumulate in float32).
      unembedding: `[H, V]` unembedding matrix; with `vocab_axis`, this device's `[H, V/D]`
        shard of it.
      targets: `[...]` integer token ids in `[0, V)` (global ids also when sharded). An id
        outside that range at a counted position is a `ValueError` when the ids can be read
        (outside `jax.jit`); under `jit` the position's log-prob is NaN (see `token_logps`).
      bias: optional `[V]` bias (the local shard with `vocab_axis`).
      temperature: $\tau > 0$; may be traced.
      softcap: $c > 0$, static, or None (no capping).
      with_entropy: also return the per-token entropy $H_n$ (static).
      where: `[...]` mask, True (or 1) = counts; masked positions give 0 and send exactly 0
        gradient, even when their hidden states are NaN and their targets out of range.
      chunk_size: vocabulary tile width of the ``"chunked"`` path (static). Temporary memory
        is about two `[N, chunk_size]` float32 arrays. None picks `default_chunk_size(N)`, the
        power of two that keeps a tile near $2^{22}$ logits (16 MiB in float32), between 128
        and 8192 columns: 1024 for 4096 tokens.
      implementation: ``"chunked"`` (pure JAX, any backend), ``"pallas"`` (the Pallas kernel
        of `tunelib.kernels`, for GPU and TPU), ``"naive"`` (materialise the logits: the
        reference, and the baseline for benchmarks), or ``"auto"``: the fastest at bounded
        memory on the backend, measured (`benchmarks/README.md`), today ``"chunked"`` on
        all three: on the Gemma-2-2B head with gradients, on a TPU v5e 238-242 ms against
        the Mosaic kernel's 253-268 ms at its best blocks, on an H200 176 ms against the
        Triton kernel's 554 ms, for about the same memory.
      vocab_axis: inside `jax.shard_map`, the name of the mesh axis the vocabulary is sharded
        over (a tensor-parallel head): each device streams its own shard and the log-sum-exp,
        target logit and entropy are combined across the axis. Not supported by ``"pallas"``.

    Returns:
      `[...]` log-probs, float32 (float64 for float64 inputs); with `with_entropy`, the pair
      `(logps, entropy)`.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from tunelib.logprobs import fused_token_logps, token_logps
      >>> h = jax.random.normal(jax.random.key(0), (2, 3, 8))
      >>> w = jax.random.normal(jax.random.key(1), (8, 50))
      >>> y = jnp.array([[1, 7, 49], [0, 0, 3]])
      >>> fused = fused_token_logps(h, w, y, chunk_size=16)
      >>> bool(jnp.allclose(fused, token_logps(h @ w, y), atol=1e-5))
      True

    References:
      Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models", 2024,
      https://arxiv.org/abs/2411.09009 (the same idea for the cross-entropy loss).
      Milakov and Gimelshein, "Online normalizer calculation for softmax", 2018,
      https://arxiv.org/abs/1805.02867.
    """
    hidden = v.float_array(hidden, "hidden")
    v.check_ndim(hidden, "hidden", at_least=1)
    unembedding = v.float_array(unembedding, "unembedding")
    if unembedding.ndim != 2 or unembedding.shape[0] != hidden.shape[-1]:
        raise ValueError(
            f"unembedding must have shape [H, V] with H = {hidden.shape[-1]} (hidden's last "
            f"axis), got {tuple(unembedding.shape)}."
        )
    targets = v.int_array(targets, "targets")
    v.check_shape(targets, "targets", hidden.shape[:-1], f"hidden {tuple(hidden.shape)} without H")
    if bias is not None:
        bias = v.float_array(bias, "bias")
        v.check_shape(bias, "bias", unembedding.shape[1:], f"unembedding {unembedding.shape}")
    if chunk_size is None:
        chunk_size = default_chunk_size(targets.size)
    v.static_count(chunk_size, "chunk_size")
    v.positive_scalar(temperature, "temperature")
    implementation = _resolve(implementation)
    if implementation == "pallas" and vocab_axis is not None:
        raise ValueError("implementation='pallas' does not support vocab_axis; use 'chunked'.")
    softcap = v.softcap(softcap)
    where = v.mask_array(where, targets.shape)
    vocab = unembedding.shape[1]
    if vocab_axis is not None:
        vocab *= lax.axis_size(vocab_axis)
    targets, inside = v.token_id_array(targets, vocab, where)
    shape = targets.shape
    h = jnp.where(where[..., None], hidden, 0).reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    tau = jnp.asarray(temperature, v.compute_dtype(hidden.dtype, unembedding.dtype))
    if implementation == "chunked":
        logps, entropy = _chunked(
            h, unembedding, bias, y, tau, chunk_size, with_entropy, vocab_axis, softcap
        )
    elif implementation == "naive":
        logps, entropy = _naive(h, unembedding, bias, y, tau, with_entropy, vocab_axis, softcap)
    else:
        from tunelib.kernels import fused_token_logps_pallas

        # Forced onto a CPU, the kernel runs in the Pallas interpreter: right, and slow.
        out = fused_token_logps_pallas(
            h, unembedding, y, bias=bias, temperature=tau, softcap=softcap, with_entropy=True,
            interpret=jax.default_backend() == "cpu",
        )  # fmt: skip
        logps, entropy = out
    logps = jnp.where(where, jnp.where(inside, logps.reshape(shape), jnp.nan), 0.0)
    if not with_entropy:
        return logps
    return logps, jnp.where(where, entropy.reshape(shape), 0.0)
