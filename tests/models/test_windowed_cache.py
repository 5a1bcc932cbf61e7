"""Windowed KV caches (`Decoder.init_cache(..., windowed=True)`): sliding-window layers keep a
ring of their window's slots, and `extend` gives the hidden states of the full cache."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests._helpers import raises_naming, x64_copies
from tests.models.test_gemma4 import DENSE as GEMMA4
from tunelib.models import Decoder, DecoderConfig

GEMMA3 = dict(
    vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
    layer_types=("sliding_attention", "full_attention", "sliding_attention"),
    rope_local_base_freq=1e4, rope_theta=1e6, query_pre_attn_scalar=8, use_qk_norm=True,
    norm_offset=True, sandwich_norms=True, hidden_act="gelu_pytorch_tanh",
    tie_word_embeddings=True, initializer_range=0.2,
)  # fmt: skip
# 26 columns: a 9-column prefill (longer than the window), a block of 3 (as an episode's
# observation), then one column at a time across the window several times. Left padding,
# and padding mid-row (a row that waits) inside the block and the steps.
ROWS = np.random.default_rng(0).integers(0, 32, (3, 26))
WHERE = np.ones(ROWS.shape, bool)
WHERE[0, :4] = False
WHERE[1, 10:12] = False
WHERE[2, 15:17] = False
PIECES = ((0, 9), (9, 12), *((i, i + 1) for i in range(12, 26)))


@functools.partial(jax.jit, static_argnums=0)
def extend(graphdef, state, tokens, where, cache):
    return nnx.merge(graphdef, state).extend(tokens, where, cache)


def cached(graphdef, state, tokens, where, cache):
    """The hidden states of `tokens` extended into `cache` in `PIECES`, and the cache."""
    outs = []
    for a, b in PIECES:
        hidden, cache = extend(graphdef, state, tokens[:, a:b], where[:, a:b], cache)
        outs.append(hidden)
    return np.where(where[..., None], np.concatenate(outs, axis=1), 0), cache


def test_rings_hold_the_window_and_only_sliding_layers_keep_one():
    model = Decoder(DecoderConfig(**GEMMA3, scan_layers=True), rngs=nnx.Rngs(0))
    full, windowed = model.init_cache(2, 40), model.init_cache(2, 40, windowed=True)
    assert [k.shape for k in full.keys] == [(3, 2, 2, 40, 8)]
    # The two sliding layers in a ring of W = 4 slots, the full layer in all 40.
    assert [k.shape for k in windowed.keys] == [(2, 2, 2, 4, 8), (1, 2, 2, 40, 8)]
    assert [x.shape for x in windowed.values] == [k.shape for k in windowed.keys]
    assert windowed.where.shape == full.where.shape == (2, 40)
    # A cache no longer than the ring, and a model without sliding layers: nothing to save.
    short = model.init_cache(2, 4, windowed=True)
    assert [k.shape for k in short.keys] == [(3, 2, 2, 4, 8)]
    plain = Decoder(DecoderConfig(**{**GEMMA3, "layer_types": None, "sliding_window": None}),
                    rngs=nnx.Rngs(0))  # fmt: skip
    assert [k.shape for k in plain.init_cache(2, 40, windowed=True).keys] == [(3, 2, 2, 40, 8)]
    with raises_naming("windowed"):
        model.init_cache(2, 40, windowed=1)
    other = Decoder(DecoderConfig(**{**GEMMA3, "sliding_window": 6}), rngs=nnx.Rngs(0))
    with raises_naming("cache.keys", "init_cache"):
        other.extend(ROWS[:2, :2], None, windowed)


def test_stacked_layers_of_two_kinds_equal_the_full_cache_in_float64():
    """Gemma 3's alternation in one scan (a ring and a full cache, chosen per layer) and in
    `decoding_layout`'s per-layer parameters: the full cache's hidden states to float64
    rounding, with every slot the window sees and no other."""
    tokens, where = x64_copies(ROWS, WHERE)
    with jax.enable_x64(True):
        config = DecoderConfig(**GEMMA3, scan_layers=True, dtype="float64", param_dtype="float64")
        model = Decoder(config, rngs=nnx.Rngs(1))
        graphdef, state = nnx.split(model)
        per_layer = model.decoding_layout(nnx.to_pure_dict(state))
        expected, _ = cached(graphdef, state, tokens, where, model.init_cache(3, 30))
        for params in (state, per_layer):
            ring = model.init_cache(3, 30, windowed=True)
            hidden, ring = cached(graphdef, params, tokens, where, ring)
            np.testing.assert_allclose(hidden, expected, rtol=1e-12, atol=1e-12)
            assert int(ring.index) == 26 and ring.keys[0].shape[3] == 4
            np.testing.assert_array_equal(ring.lengths, where.sum(1))


def test_unrolled_layers_that_share_keys_equal_the_full_cache():
    """Gemma 4's layers (two widths, sliding layers reading another layer's ring): as close to
    the uncached forward as the full cache is (float32, whose rounding differs by CPU; the
    ring sums attention in another order), within a factor 4."""
    model = Decoder(DecoderConfig(**GEMMA4), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    tokens = np.where(WHERE, ROWS % GEMMA4["vocab_size"], 0)
    full, _ = cached(graphdef, state, tokens, WHERE, model.init_cache(3, 30))
    ring_cache = model.init_cache(3, 30, windowed=True)
    assert [k.shape[3] for k in ring_cache.keys] == [3, 30]  # window 3: a ring of 3
    ring, _ = cached(graphdef, state, tokens, WHERE, ring_cache)
    forward = jax.jit(lambda s, t, w: nnx.merge(graphdef, s)(t, where=w))(state, tokens, WHERE)
    forward = np.where(WHERE[..., None], forward, 0)
    scale = np.abs(forward).max()
    assert np.abs(ring - forward).max() <= 4 * np.abs(full - forward).max() + 1e-6 * scale
    assert np.abs(ring - full).max() < 1e-4 * scale


@pytest.mark.parametrize("window", [1, 2])
def test_the_smallest_windows(window):
    """A window of one slot (a query sees itself) or two: rings of one and two slots."""
    with jax.enable_x64(True):
        tokens, where = x64_copies(ROWS[:2, :14], WHERE[:2, :14])
        config = DecoderConfig(**{**GEMMA3, "sliding_window": window, "num_hidden_layers": 2,
                                  "layer_types": ("sliding_attention",) * 2},
                               dtype="float64", param_dtype="float64")  # fmt: skip
        model = Decoder(config, rngs=nnx.Rngs(2))
        run = jax.jit(lambda t, w, c: model.extend(t, w, c))
        forward = np.where(where[..., None], model(tokens, where=where), 0)
        cache = model.init_cache(2, 14, windowed=True)
        assert cache.keys[0].shape[3] == window
        outs = []
        for a, b in ((0, 5), *((i, i + 1) for i in range(5, 14))):
            hidden, cache = run(tokens[:, a:b], where[:, a:b], cache)
            outs.append(hidden)
        hidden = np.where(where[..., None], jnp.concatenate(outs, axis=1), 0)
        np.testing.assert_allclose(hidden, forward, rtol=1e-12, atol=1e-12)
