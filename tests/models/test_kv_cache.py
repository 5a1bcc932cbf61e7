import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests._helpers import assert_close, raises_naming
from tests.models.test_decoder import VARIANTS, build, forward, make_config
from tunelib.models import KVCache
from tunelib.models._layers import cache_buckets

# Left-padded, unpadded and right-padded rows; columns 0-4 are the "prompt", 5-9 "decoded".
TOKENS = np.array(
    [
        [0, 0, 3, 17, 9, 30, 1, 22, 8, 4],
        [5, 5, 12, 13, 31, 7, 7, 2, 19, 11],
        [6, 21, 9, 0, 0, 14, 2, 26, 19, 3],
    ]
)
WHERE = np.ones(TOKENS.shape, bool)
WHERE[0, :2] = False
WHERE[2, 3:5] = False
WHERE[1, 8] = False  # a padding slot mid-decode (a row that has stopped, say)


@functools.partial(jax.jit, static_argnums=0)
def extend(graphdef, state, tokens, where, cache):
    """`Decoder.extend`, jitted once per config and shape (shared by the tests)."""
    return nnx.merge(graphdef, state).extend(tokens, where, cache)


def cached_hidden(model, tokens, where, prefill: int, slots: int):
    """Hidden states from one prefill of `prefill` columns, then one column at a time."""
    graphdef, state = nnx.split(model)
    cache = model.init_cache(tokens.shape[0], slots)
    hidden, cache = extend(graphdef, state, tokens[:, :prefill], where[:, :prefill], cache)
    outs = [hidden]
    for i in range(prefill, tokens.shape[1]):
        hidden, cache = extend(graphdef, state, tokens[:, i : i + 1], where[:, i : i + 1], cache)
        outs.append(hidden)
    return jnp.concatenate(outs, axis=1), cache


@pytest.mark.parametrize(
    ("variant", "scan"), [(name, False) for name in VARIANTS] + [("default", True)]
)
def test_cached_decoding_equals_the_full_forward(variant, scan):
    model = build(make_config(**VARIANTS[variant], scan_layers=scan))
    expected, _ = forward(model)(TOKENS, WHERE)
    # An exact fit, and (once) spare slots that are never written.
    for slots in (10, 16) if variant == "default" else (10,):
        hidden, cache = cached_hidden(model, TOKENS, WHERE, prefill=5, slots=slots)
        assert_close(np.where(WHERE[..., None], hidden, 0), np.where(WHERE[..., None], expected, 0),
                     rtol=1e-5, atol=2e-5)  # fmt: skip
        assert int(cache.index) == 10
        np.testing.assert_array_equal(cache.lengths, WHERE.sum(1))
        np.testing.assert_array_equal(cache.where[:, :10], WHERE)
        assert not np.asarray(cache.where[:, 10:]).any()


def test_prefill_in_pieces_equals_one_prefill():
    model = build(make_config())
    # 16 slots, as in the spare-slot case above: the one-column step compiles nothing new.
    whole, _ = cached_hidden(model, TOKENS, WHERE, prefill=10, slots=16)
    pieces, _ = cached_hidden(model, TOKENS, WHERE, prefill=3, slots=16)
    assert_close(np.where(WHERE[..., None], pieces, 0), np.where(WHERE[..., None], whole, 0),
                 rtol=1e-5, atol=2e-5)  # fmt: skip


def test_logits_of_the_last_token_match():
    # Untied embeddings (the head is its own matrix); the decoder of the `untied_mha` case
    # above, whose forward and one-column step are compiled already.
    model = build(make_config(**VARIANTS["untied_mha"]))
    assert model.lm_head is not None
    _, logits = forward(model)(TOKENS, WHERE)
    hidden, _ = cached_hidden(model, TOKENS, WHERE, prefill=9, slots=10)
    assert_close(model.unembed(hidden[:, -1]), logits[:, -1], rtol=1e-5, atol=1e-4)


def test_bf16_cache():
    model = build(make_config(dtype="bfloat16"))
    cache = model.init_cache(3, 10)
    (keys,), (values,) = cache.keys, cache.values  # one group: every layer has one shape
    assert keys.dtype == jnp.bfloat16 and values.shape == (2, 3, 2, 10, 16)
    hidden, _ = cached_hidden(model, TOKENS, WHERE, prefill=5, slots=10)
    expected, _ = forward(model)(TOKENS, WHERE)
    mask = WHERE[..., None]
    assert_close(np.where(mask, hidden.astype(jnp.float32), 0),
                 np.where(mask, expected.astype(jnp.float32), 0), rtol=0.05, atol=0.05)  # fmt: skip


def test_cache_is_a_pytree_with_documented_shapes():
    model = build(make_config(num_hidden_layers=3))
    cache = model.init_cache(2, 7)
    assert isinstance(cache, KVCache)
    assert [k.shape for k in cache.keys] == [(3, 2, 2, 7, 16)] and cache.where.shape == (2, 7)
    assert cache.lengths.dtype == jnp.int32 and cache.index.shape == ()
    assert len(jax.tree.leaves(cache)) == 5


def test_errors_name_the_argument():
    model = build(make_config())
    cache = model.init_cache(3, 4)
    with raises_naming("length"):
        model.init_cache(3, 0)
    with raises_naming("batch_size"):
        model.init_cache(True, 4)
    with raises_naming("cache", "5"):
        model.extend(TOKENS[:, :5], WHERE[:, :5], cache)
    with raises_naming("rows", "2"):
        model.extend(TOKENS[:2, :2], WHERE[:2, :2], cache)
    with raises_naming("tokens"):
        model.extend(TOKENS[:, :2].astype(np.float32), WHERE[:, :2], cache)


def test_cache_buckets_are_few_ascending_and_end_at_the_cache():
    assert cache_buckets(10) == (10,) and cache_buckets(32) == (32,)
    assert cache_buckets(80) == (32, 64, 80)
    assert cache_buckets(272) == (64, 128, 192, 256, 272)
    for slots in (33, 257, 1000, 2048, 5000):
        buckets = cache_buckets(slots)
        assert 1 < len(buckets) <= 8 and buckets[-1] == slots
        assert all(a < b for a, b in itertools.pairwise(buckets))
        assert all(n % 32 == 0 for n in buckets[:-1])


@pytest.mark.parametrize(("variant", "scan"), [("default", True), ("sliding_window", False)])
def test_decoding_across_buckets_equals_the_full_forward(variant, scan):
    # 70 columns into 80 slots: the steps attend over 32, 64, then 80 slots.
    model = build(make_config(**VARIANTS[variant], scan_layers=scan))
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 32, (2, 70))
    where = np.ones(tokens.shape, bool)
    where[0, :3] = False  # left padding
    where[1, 40:43] = False  # a padding slot mid-decode, in the second bucket
    expected, _ = forward(model)(tokens, where)
    hidden, cache = cached_hidden(model, tokens, where, prefill=20, slots=80)
    assert_close(np.where(where[..., None], hidden, 0), np.where(where[..., None], expected, 0),
                 rtol=1e-5, atol=2e-5)  # fmt: skip
    assert int(cache.index) == 70
