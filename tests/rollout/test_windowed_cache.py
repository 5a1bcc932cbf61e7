"""`sample` with windowed KV caches (`windowed_cache=True`, the default):
the tokens and behaviour log-probs of every slot kept (`windowed_cache=False`), in float64,
where the two orders of summing attention agree to rounding."""

import jax
import numpy as np
from flax import nnx

from tests._helpers import raises_naming, x64_copies
from tests.models.test_windowed_cache import GEMMA3
from tunelib.models import Decoder, DecoderConfig
from tunelib.rollout import SamplingConfig, sample

# Prompts longer than the window (4), the first left-padded; 13 new tokens cross the window
# three times (greedy); stop tokens end sampled completions early.
PROMPTS = np.array([[0, 0, 5, 9, 3, 17, 2], [7, 1, 4, 4, 8, 30, 12]], np.int32)
PROMPT_WHERE = np.array([[False, False] + [True] * 5, [True] * 7])
STOPS = (3, 11, 19)


def float64_model(**overrides):
    config = DecoderConfig(**{**GEMMA3, **overrides}, dtype="float64", param_dtype="float64")
    return nnx.split(Decoder(config, rngs=nnx.Rngs(4)))


def assert_same_rollouts(a, b):
    for name in ("tokens", "where", "lengths", "truncated"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    np.testing.assert_allclose(a.logps, b.logps, rtol=1e-12, atol=1e-12)


def test_sample_with_windowed_caches_equals_every_slot_kept():
    """Gemma 3's alternation: stacked (a ring and a full cache in one scan) and per layer,
    greedy and sampled, two completions per prompt from one prefill."""
    prompts, where = x64_copies(PROMPTS, PROMPT_WHERE)
    with jax.enable_x64(True):
        graphdef, params = float64_model(scan_layers=True)
        key = jax.random.key(7)
        greedy = SamplingConfig(max_new_tokens=13, temperature=0.0)
        sampled = SamplingConfig(max_new_tokens=13, temperature=0.9, stop_tokens=STOPS)
        full = {}
        for config in (greedy, sampled):
            full[config], windowed = (
                sample(graphdef, params, prompts, where, key, config, group_size=2,
                       windowed_cache=w) for w in (False, True)
            )  # fmt: skip
            assert_same_rollouts(windowed, full[config])
        assert not np.asarray(full[sampled].truncated).all()  # stop tokens drawn
        per_layer = sample(graphdef, params, prompts, where, key, greedy, group_size=2,
                           layout="per_layer")  # fmt: skip
        assert_same_rollouts(per_layer, full[greedy])


def test_sample_with_unrolled_sliding_layers():
    """Mistral: every layer slides, the layers unrolled."""
    prompts, where = x64_copies(PROMPTS, PROMPT_WHERE)
    with jax.enable_x64(True):
        graphdef, params = float64_model(layer_types=None, sliding_window=3)
        config = SamplingConfig(max_new_tokens=13, temperature=0.0)
        full, windowed = (
            sample(graphdef, params, prompts, where, jax.random.key(0), config, windowed_cache=w)
            for w in (False, True)
        )
        assert_same_rollouts(windowed, full)


def test_windowed_cache_must_be_a_bool():
    graphdef, params = nnx.split(Decoder(DecoderConfig(**GEMMA3), rngs=nnx.Rngs(0)))
    with raises_naming("windowed_cache"):
        sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(0),
               SamplingConfig(max_new_tokens=2), windowed_cache="yes")  # fmt: skip
