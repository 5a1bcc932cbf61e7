"""Vocabulary tiles shared by the fused heads: no `[N, V]` array, no copy of the unembedding."""

import jax
import jax.numpy as jnp
from jax import lax

# A tile of about this many logits (16 MiB in float32) when the caller picks no width.
TILE_LOGITS = 2**22


def default_chunk_size(num_tokens: int) -> int:
    """The vocabulary tile width the fused heads use when they are given none.

    The power of two that keeps a tile of `num_tokens` rows near $2^{22}$ logits (16 MiB in
    float32), between 128 and 8192 columns.

    Args:
      num_tokens: the number of tokens `N` (rows) of the head.

    Returns:
      The tile width in vocabulary columns, a Python int.

    Examples:
      >>> from tunelib.logprobs import default_chunk_size
      >>> print(default_chunk_size(4096), default_chunk_size(1), default_chunk_size(10**6))
      1024 8192 128
    """
    columns = TILE_LOGITS // max(num_tokens, 1)
    return 1 << max(7, min(13, columns.bit_length() - 1)) if columns else 128


def tiles(vocab: int, chunk: int) -> tuple[int, int]:
    """The tile width and the number of tiles covering `vocab` columns."""
    chunk = min(chunk, vocab)
    return chunk, -(-vocab // chunk)


def vocab_tile(w, b, index, chunk):
    """Tile `index` of an unembedding (and bias), its first column and the columns it owns.

    The last tile is shifted left to end at the last column instead of padding the vocabulary
    (which would copy the unembedding); the columns it shares with the previous tile are not
    owned and are left out.
    """
    vocab = w.shape[1]
    start = jnp.minimum(index * chunk, vocab - chunk)
    w_tile = read_columns(w, start, chunk)
    b_tile = None if b is None else lax.dynamic_slice_in_dim(b, start, chunk, axis=0)
    owned = start + jnp.arange(chunk) >= index * chunk
    return start, w_tile, b_tile, owned


def tile_logits(h, w_tile, b_tile, tau, dtype, softcap=None):
    """`(h W + b) / tau` on one tile, accumulated in `dtype`; with `softcap` c,
    `c tanh((h W + b) / c) / tau`."""
    z = jnp.matmul(h, w_tile, preferred_element_type=dtype)
    if b_tile is not None:
        z = z + b_tile.astype(dtype)
    return capped(z, softcap) / tau


def capped(z, softcap):
    r"""Final-logit soft-capping, $c \tanh(z / c)$ (Gemma 2 and 4), or `z` for None."""
    return z if softcap is None else softcap * jnp.tanh(z / softcap)


def cap_slope(z, tau, softcap):
    r"""$d\,[c \tanh(l / c)] / dl = 1 - \tanh^2(l / c)$, from the capped, tempered `z`."""
    return 1.0 if softcap is None else 1.0 - jnp.square(z * tau / softcap)


# XLA's CPU backend has no 16-bit float dynamic slice or update: it converts the whole operand
# to float32 around each one. In a tile loop that would cost a float32 copy of the unembedding
# (hoisted out of the loop as invariant) to read tiles, and a pass over all of `[H, V]` for
# each tile written. So on CPU the tile loops read 16-bit floats as their bits (`uint16`),
# carrying the arrays they read behind an optimisation barrier, which keeps the compiler from
# hoisting a whole-array conversion out of the loop. A 16-bit gradient is written through a
# narrow `uint16` buffer of about 1/`FLUSHES` of its columns, flushed into the gradient (one
# pass over it) at most `FLUSHES` times: a `uint16` buffer of all of `[H, V]` would need a full
# copy at the end, since XLA never lets buffers of two element types alias. Other backends
# slice and update 16-bit floats in place and skip all of this.
FLUSHES = 16


def _as_bits(dtype) -> bool:
    """Whether the tile loops move arrays of `dtype` as `uint16` bits (16-bit floats on CPU)."""
    return jax.default_backend() == "cpu" and jnp.dtype(dtype).itemsize == 2


def tile_loop(lower, upper, body, init, operands):
    """`lax.fori_loop(lower, upper, ...)` of `body(i, carry, *operands)` from `init`.

    `operands` are the arrays the body reads tiles of (the unembeddings). Where the tiles are
    read as bits (16-bit floats on CPU), they are carried through the loop behind an
    optimisation barrier rather than closed over, so that no conversion of a whole operand is
    hoisted out of the loop; the carry aliases the operands and copies nothing.
    """
    if not any(_as_bits(x.dtype) for x in operands):
        return lax.fori_loop(lower, upper, lambda i, carry: body(i, carry, *operands), init)

    def carried(i, state):
        carry, held = state
        held = lax.optimization_barrier(held)
        return body(i, carry, *held), held

    return lax.fori_loop(lower, upper, carried, (init, tuple(operands)))[0]


def read_columns(x, start, width):
    """Columns `[start, start + width)` of `x` (`[H, V]`), a dynamic slice."""
    if not _as_bits(x.dtype):
        return lax.dynamic_slice_in_dim(x, start, width, axis=1)
    bits = lax.bitcast_convert_type(x, jnp.uint16)
    return lax.bitcast_convert_type(lax.dynamic_slice_in_dim(bits, start, width, 1), x.dtype)


def varying_zero(*arrays):
    """A float32 `[1, 1]` zero that, inside `shard_map`, varies over every mesh axis that one
    of `arrays` varies over: added to a loop's initial carry, it gives the carry the type of
    what the tiles compute from those arrays. Outside `shard_map`, just a zero."""
    zero = jnp.zeros((1, 1), jnp.float32)
    for x in arrays:
        if x is not None:
            zero = zero + jnp.zeros_like(x, jnp.float32).reshape(-1)[:1].reshape(1, 1)
    return zero


def write_tiles(tile, init, operands, *, n_tiles, chunk, shape, dtype, zero):
    """The tile loop of a backward pass that writes a gradient `[H, V]`, one tile at a time.

    Runs `carry, start, columns = tile(index, carry, *operands)` for `index` = `n_tiles` - 1,
    ..., 0 from `init`, and writes each tile's `columns` (`[H, chunk]`, `dtype`) once, at
    column `start` of a zero array of `shape` and `dtype`. Each tile owns a disjoint set of
    columns; the last one, shifted left to end at the last column (see `vocab_tile`), writes
    zeros over the columns it shares with the one before it, which runs after it and
    overwrites them. `zero` is a `varying_zero` for the array's type. Returns
    `(carry, array)`.
    """
    out = jnp.zeros(shape, dtype) + zero.astype(dtype)
    if not _as_bits(dtype):

        def body(i, state, *held):
            carry, out = state
            carry, start, columns = tile(n_tiles - 1 - i, carry, *held)
            return carry, lax.dynamic_update_slice_in_dim(out, columns, start, axis=1)

        return tile_loop(0, n_tiles, body, (init, out), operands)

    per_group = -(-n_tiles // FLUSHES)
    n_groups = -(-n_tiles // per_group)
    width = min(shape[1], per_group * chunk)
    empty = jnp.zeros((shape[0], width), jnp.uint16) + zero.astype(jnp.uint16)

    def group(j, state, *held):
        carry, out = state
        first = (n_groups - 1 - j) * per_group
        count = jnp.minimum(per_group, n_tiles - first)
        offset = jnp.minimum(first * chunk, shape[1] - width)  # shifted left like the tiles

        def one(i, inner, *held):
            carry, buffer = inner
            carry, start, columns = tile(first + count - 1 - i, carry, *held)
            bits = lax.bitcast_convert_type(columns, jnp.uint16)
            return carry, lax.dynamic_update_slice_in_dim(buffer, bits, start - offset, axis=1)

        carry, buffer = tile_loop(0, count, one, (carry, empty), held)
        columns = lax.bitcast_convert_type(buffer, dtype)
        return carry, lax.dynamic_update_slice_in_dim(out, columns, offset, axis=1)

    return tile_loop(0, n_groups, group, (init, out), operands)
