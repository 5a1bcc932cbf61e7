r"""Windowed KV caches: a sliding-window layer keeps only the slots its window can still see.

A query at slot $t$ of a layer with window $W$ sees the keys at slots $s$ with
$t - W < s \le t$. A block of $T$ new tokens at slots $i, \dots, i + T - 1$ therefore needs,
besides its own keys, only the $W - 1$ slots before $i$. A windowed cache holds those in a
ring of $R = W - 1$ slots (slot $s$ at ring position $s \bmod R$): the block attends over the
ring followed by its own keys, then writes its last $\min(T, R)$ keys into the ring. The
window is counted in slots, padding included, as in the full cache and the uncached forward
pass, so the keys each query sees, and their weights, are the same.

The layout of a cache, in groups of layers of one shape, is `cache_groups`; a group is a
ring when its slot axis is `ring_slots(window)` rather than the cache's length (only where
the ring is the shorter). `Attention` reads and writes a layer's cache through
`LayerCache`; stacked layers of two kinds (a ring and a full cache in one scan) pass both
as `KindCaches` and choose by the layer's kind.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
from einops import rearrange

from tunelib.models._config import DecoderConfig


class CacheGroup(NamedTuple):
    """Cached layers of one shape: `kv_heads` $K$, `head_dim` $D$, `slots` (the cache's
    length, or a ring's $R$), `window` (the layers' window for a ring, else None) and the
    `members` (layer indices, in order)."""

    kv_heads: int
    head_dim: int
    slots: int
    window: int | None
    members: tuple[int, ...]


class LayerCache(NamedTuple):
    """One layer's cache as `Attention` reads it: the `[L, B, K, S, D]` keys and values of
    every layer of its group (written in place inside a decode loop), this layer's index
    `layer` in them and the slot `index` the new tokens go to; `ring` (static): the slot
    axis is a ring of the window's slots, else every slot of the cache."""

    keys: jax.Array
    values: jax.Array
    layer: jax.Array | int
    index: jax.Array
    ring: bool = False


class KindCaches(NamedTuple):
    """The caches of stacked layers of two kinds (full, then sliding), and the `kind` of the
    layer being run (traced): each layer reads and writes its own kind's cache."""

    caches: tuple[LayerCache, LayerCache]
    kind: jax.Array


def layer_windows(config: DecoderConfig) -> tuple[int | None, ...]:
    """Each layer's window $W$ in slots (None: full attention)."""
    return tuple(config.sliding_window if s else None for s in config.sliding_layers)


def ring_slots(window: int) -> int:
    """The slots a ring keeps for a window of $W$ slots: the $W - 1$ before a query (one at
    least)."""
    return max(window - 1, 1)


def cache_groups(config: DecoderConfig, length: int, windowed: bool) -> list[CacheGroup]:
    """The cached layers of a cache of `length` slots, grouped by `(K, D, slots)` in order of
    first appearance. Layers sharing another's keys and values are left out. With
    `windowed`, a sliding layer whose ring is shorter than `length` keeps a ring."""
    windows = layer_windows(config)
    groups: dict[tuple, list[int]] = {}
    for i, source in enumerate(config.kv_sources):
        if source != i:
            continue
        window = windows[i]
        ringed = windowed and window is not None and ring_slots(window) < length
        shape = (config.layer_kv_heads[i], config.layer_head_dims[i])
        key = (*shape, ring_slots(window), window) if ringed else (*shape, length, None)
        groups.setdefault(key, []).append(i)
    return [CacheGroup(*key, tuple(members)) for key, members in groups.items()]


def ring_key_slots(index: jax.Array, ring: int) -> jax.Array:
    """`[R]`: the slot each ring position holds before a block written at `index` (the
    latest slot below `index` at that position); negative where none was written yet."""
    last = index - 1
    return last - jnp.mod(last - jnp.arange(ring), ring)


def ring_mask(
    key_where: jax.Array, index: jax.Array, tokens: int, ring: int, window: int, dtype
) -> tuple[jax.Array, jax.Array]:
    """Which keys of `[ring, new tokens]` each of `tokens` new queries sees, `[B, 1, 1, T,
    R + T]`, and the scores of the others, `[T, R + T]` (as `Decoder`'s masks: finite, the
    future lowest). `key_where` `[B, S]` says which slots hold real tokens, these included."""
    ring_slot = ring_key_slots(index, ring)
    new_slot = index + jnp.arange(tokens)
    key_slot = jnp.concatenate([ring_slot, new_slot])
    taken = jnp.take(key_where, jnp.maximum(key_slot, 0), axis=1) & (key_slot >= 0)[None]
    causal = key_slot[None, :] <= new_slot[:, None]
    seen = causal & (key_slot[None, :] > new_slot[:, None] - window)
    allowed = rearrange(seen[None] & taken[:, None, :], "b t s -> b 1 1 t s")
    lowest = jnp.finfo(dtype).min
    return allowed, jnp.where(causal, 0.5 * lowest, lowest).astype(dtype)


def ring_keys(cache: LayerCache, k: jax.Array, val: jax.Array):
    """The keys and values a block attends over, `[B, K, R + T, D]`: the layer's ring before
    the block, then the block's own `k`, `val` `[B, K, T, D]`."""
    old_k = jax.lax.dynamic_index_in_dim(cache.keys, cache.layer, keepdims=False)
    old_v = jax.lax.dynamic_index_in_dim(cache.values, cache.layer, keepdims=False)
    return (
        jnp.concatenate([old_k, k.astype(old_k.dtype)], axis=2),
        jnp.concatenate([old_v, val.astype(old_v.dtype)], axis=2),
    )


def write_ring(cache: LayerCache, k: jax.Array, val: jax.Array) -> LayerCache:
    r"""The cache with the last $\min(T, R)$ of the block's keys and values `[B, K, T, D]`
    written at their ring positions (slot mod R)."""
    ring, tokens = cache.keys.shape[3], k.shape[2]
    kept = min(tokens, ring)
    k, val = k[:, :, tokens - kept :], val[:, :, tokens - kept :]
    first = cache.index + tokens - kept
    if kept == 1:  # a decode step: one slot, written in place
        at = tuple(jnp.asarray(i, jnp.int32) for i in (cache.layer, 0, 0, first % ring, 0))
        keys = jax.lax.dynamic_update_slice(cache.keys, k.astype(cache.keys.dtype)[None], at)
        values = jax.lax.dynamic_update_slice(cache.values, val.astype(cache.keys.dtype)[None], at)
    else:
        at = jnp.mod(first + jnp.arange(kept), ring)
        keys = cache.keys.at[cache.layer, :, :, at].set(
            rearrange(k, "b k t d -> t b k d").astype(cache.keys.dtype)
        )
        values = cache.values.at[cache.layer, :, :, at].set(
            rearrange(val, "b k t d -> t b k d").astype(cache.values.dtype)
        )
    return cache._replace(keys=keys, values=values)
