r"""Windowed KV caches: a sliding-window layer keeps only the slots its window can still see.

A query at slot $t$ of a layer with window $W$ sees the keys at slots $s$ with
$t - W < s \le t$: the $W$ latest slots. A windowed cache holds them in a ring of $R = W$
slots (slot $s$ at ring position $s \bmod R$). A decode step writes its key into the ring and
attends over it, as over a full cache. A block of $T > 1$ tokens at slots
$i, \dots, i + T - 1$ needs the $W - 1$ slots before $i$ and its own keys: it attends over the
ring as it was, followed by its own keys, then writes its last $\min(T, R)$ keys into the
ring. The window is counted in slots, padding included, as in the full cache and the
uncached forward pass, so the keys each query sees, and their weights, are the same.

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
    """Cached layers of one shape: `kv_heads` $K$, `head_dim` $D$ (of the keys),
    `value_dim` (of the values: $D$, or 0 for multi-head latent attention, whose values
    are part of its cached latent), `slots` (the cache's length, or a ring's $R$), `window`
    (the layers' window for a ring, else None) and the `members` (layer indices, in
    order)."""

    kv_heads: int
    head_dim: int
    value_dim: int
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
    """The slots a ring keeps for a window of $W$ slots."""
    return window


def cache_groups(config: DecoderConfig, length: int, windowed: bool) -> list[CacheGroup]:
    """The cached layers of a cache of `length` slots, grouped by `(K, D, value width, slots)`
    in order of first appearance. Layers sharing another's keys and values, and Gated DeltaNet
    layers (which cache a state instead: `KVCache.conv`, `KVCache.recurrent`), are left out. With
    `windowed`, a sliding layer whose ring is shorter than `length` keeps a ring."""
    windows = layer_windows(config)
    groups: dict[tuple, list[int]] = {}
    for i, source in enumerate(config.kv_sources):
        if source != i or config.linear_layers[i]:
            continue
        window = windows[i]
        ringed = windowed and window is not None and ring_slots(window) < length
        shape = config.layer_cache_widths[i]
        key = (*shape, ring_slots(window), window) if ringed else (*shape, length, None)
        groups.setdefault(key, []).append(i)
    return [CacheGroup(*key, tuple(members)) for key, members in groups.items()]


def reads_before_writing(cache: LayerCache, tokens: int) -> bool:
    """Whether a block of `tokens` attends over `cache` before it is written: a ring given
    several tokens (they may overwrite slots their first queries see)."""
    return cache.ring and tokens > 1


def ring_key_slots(index: jax.Array, tokens: int, ring: int) -> jax.Array:
    """The slot of each key a block of `tokens` at `index` attends over (negative: none
    written yet): `[R]`, each ring position's latest slot once a decode step's key is
    written; for a longer block, `[R + T]`, the ring's before the block, then its own."""
    if tokens == 1:
        return index - jnp.mod(index - jnp.arange(ring), ring)
    last = index - 1
    before = last - jnp.mod(last - jnp.arange(ring), ring)
    return jnp.concatenate([before, index + jnp.arange(tokens)])


def ring_mask(
    key_where: jax.Array, index: jax.Array, tokens: int, ring: int, window: int, dtype
) -> tuple[jax.Array, jax.Array]:
    """Which keys each of `tokens` new queries sees, `[B, 1, 1, T, K]`, and the scores of the
    others, `[T, K]`, over the `K` keys of `ring_key_slots` (as `Decoder`'s masks: finite,
    the future lowest). `key_where` `[B, S]` says which slots hold real tokens, these
    included."""
    key_slot = ring_key_slots(index, tokens, ring)
    new_slot = index + jnp.arange(tokens)
    taken = jnp.take(key_where, jnp.maximum(key_slot, 0), axis=1) & (key_slot >= 0)[None]
    causal = key_slot[None, :] <= new_slot[:, None]
    seen = causal & (key_slot[None, :] > new_slot[:, None] - window)
    allowed = rearrange(seen[None] & taken[:, None, :], "b t s -> b 1 1 t s")
    lowest = jnp.finfo(dtype).min
    return allowed, jnp.where(causal, 0.5 * lowest, lowest).astype(dtype)


def ring_keys(cache: LayerCache, k: jax.Array, val: jax.Array):
    """The keys and values a block of several tokens attends over, `[B, K, R + T, D]`: the
    layer's ring before the block, then the block's own `k`, `val` `[B, K, T, D]` (what a
    layer sharing this layer's keys and values is given)."""
    old_k = jax.lax.dynamic_index_in_dim(cache.keys, cache.layer, keepdims=False)
    old_v = jax.lax.dynamic_index_in_dim(cache.values, cache.layer, keepdims=False)
    return (
        jnp.concatenate([old_k, k.astype(old_k.dtype)], axis=2),
        jnp.concatenate([old_v, val.astype(old_v.dtype)], axis=2),
    )


def write(cache: LayerCache, k: jax.Array, val: jax.Array, enabled=True) -> LayerCache:
    """`write_ring` or `write_slots`, as `cache` is a ring or not."""
    return (write_ring if cache.ring else write_slots)(cache, k, val, enabled)


def write_slots(cache: LayerCache, k: jax.Array, val: jax.Array, enabled=True) -> LayerCache:
    """The full-layout cache with the block's keys and values `[B, K, T, D]` written at slots
    `index` to `index + T - 1` of its layer; with `enabled` False (traced), the slots are
    written with what they hold (stacked layers of another kind, `KindCaches`)."""
    at = (cache.layer, 0, 0, cache.index, 0)
    return cache._replace(
        keys=_update(cache.keys, k, at, enabled), values=_update(cache.values, val, at, enabled)
    )


def write_ring(cache: LayerCache, k: jax.Array, val: jax.Array, enabled=True) -> LayerCache:
    r"""The ring with the last $\min(T, R)$ of the block's keys and values `[B, K, T, D]`
    written at their ring positions (slot mod R); with `enabled` False (traced), with what
    those positions hold."""
    ring, tokens = cache.keys.shape[3], k.shape[2]
    kept = min(tokens, ring)
    k, val = k[:, :, tokens - kept :], val[:, :, tokens - kept :]
    first = cache.index + tokens - kept
    if kept == 1:  # a decode step: one slot, written in place
        at = (cache.layer, 0, 0, first % ring, 0)
        return cache._replace(
            keys=_update(cache.keys, k, at, enabled),
            values=_update(cache.values, val, at, enabled),
        )
    at = jnp.mod(first + jnp.arange(kept), ring)

    def scatter(all_x, x):
        x = rearrange(x, "b k t d -> t b k d").astype(all_x.dtype)
        if enabled is not True:
            x = jnp.where(enabled, x, all_x[cache.layer, :, :, at])
        return all_x.at[cache.layer, :, :, at].set(x)

    return cache._replace(keys=scatter(cache.keys, k), values=scatter(cache.values, val))


def _update(all_x: jax.Array, x: jax.Array, at: tuple, enabled) -> jax.Array:
    """`all_x` `[L, B, K, S, D]` with `x` `[B, K, T, D]` written at `at` (or, with `enabled`
    False, what is there)."""
    at = tuple(jnp.asarray(i, jnp.int32) for i in at)
    x = x.astype(all_x.dtype)[None]
    if enabled is not True:
        x = jnp.where(enabled, x, jax.lax.dynamic_slice(all_x, at, x.shape))
    return jax.lax.dynamic_update_slice(all_x, x, at)
