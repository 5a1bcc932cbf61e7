"""Vocabulary tiles shared by the fused heads: no `[N, V]` array, no copy of the unembedding."""

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
    w_tile = lax.dynamic_slice_in_dim(w, start, chunk, axis=1)
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
