import dataclasses

import jax.numpy as jnp
import pytest
from flax import nnx

from tests._helpers import own_checks, raises_naming
from tests.models.test_decoder import BASE, LLAMA3, make_config
from tunelib.models import Decoder, DecoderConfig


def test_defaults_follow_hugging_face():
    config = DecoderConfig(
        vocab_size=10,
        hidden_size=24,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=3,
    )
    assert config.num_key_value_heads == 3  # None means multi-head attention
    assert config.head_dim == 8  # None means hidden_size / num_attention_heads
    assert config.rms_norm_eps == 1e-6 and config.rope_theta == 10000.0
    assert not config.tie_word_embeddings and not config.attention_bias
    assert not config.o_proj_bias and not config.mlp_bias and config.sliding_window is None
    assert config.initializer_range == 0.02
    assert config.compute_dtype == jnp.float32 and config.storage_dtype == jnp.float32
    assert make_config(dtype="bfloat16").compute_dtype == jnp.bfloat16


def test_hashable_frozen_and_equal():
    a = make_config(rope_scaling=dict(LLAMA3))
    b = make_config(rope_scaling=dict(LLAMA3))
    assert a == b and hash(a) == hash(b)
    assert hash(a) != hash(make_config(rope_scaling={**LLAMA3, "factor": 4.0}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.vocab_size = 5
    # The model's static structure, which jit hashes, holds the config.
    graphdef, _ = nnx.split(Decoder(a, rngs=nnx.Rngs(0)))
    assert hash(graphdef) == hash(nnx.split(Decoder(b, rngs=nnx.Rngs(1)))[0])


def test_rope_scaling_is_copied_and_legacy_type_key_is_read():
    scaling = {"type": "linear", "factor": 2.0}
    config = make_config(rope_scaling=scaling)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    scaling["factor"] = 100.0
    assert config.rope_scaling["factor"] == 2.0


BAD = [
    ({"vocab_size": 0}, "vocab_size", ValueError),
    ({"hidden_size": -4}, "hidden_size", ValueError),
    ({"intermediate_size": 2.5}, "intermediate_size", TypeError),
    ({"num_hidden_layers": True}, "num_hidden_layers", TypeError),
    ({"num_attention_heads": 0}, "num_attention_heads", ValueError),
    ({"num_key_value_heads": 3}, "num_key_value_heads", ValueError),
    ({"num_key_value_heads": 0}, "num_key_value_heads", ValueError),
    ({"head_dim": 7}, "head_dim", ValueError),
    ({"head_dim": None, "hidden_size": 66}, "head_dim", ValueError),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps", ValueError),
    ({"rope_theta": float("nan")}, "rope_theta", ValueError),
    ({"initializer_range": -0.02}, "initializer_range", ValueError),
    ({"max_position_embeddings": 0}, "max_position_embeddings", ValueError),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings", TypeError),
    ({"attention_bias": "yes"}, "attention_bias", TypeError),
    ({"use_qk_norm": None}, "use_qk_norm", TypeError),
    ({"o_proj_bias": 1}, "o_proj_bias", TypeError),
    ({"mlp_bias": "no"}, "mlp_bias", TypeError),
    ({"sliding_window": 0}, "sliding_window", ValueError),
    ({"sliding_window": 4.0}, "sliding_window", TypeError),
    ({"scan_layers": 0}, "scan_layers", TypeError),
    ({"scan_unroll": 0}, "scan_unroll", ValueError),
    ({"scan_unroll": True}, "scan_unroll", TypeError),
    ({"remat": 1}, "remat", TypeError),
    ({"dtype": "float8"}, "dtype", ValueError),
    ({"param_dtype": jnp.float32}, "param_dtype", TypeError),
    ({"rope_scaling": "linear"}, "rope_scaling", TypeError),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling", ValueError),
    ({"rope_scaling": {"factor": 4.0}}, "rope_scaling", ValueError),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling", ValueError),
    ({"rope_scaling": {"rope_type": "linear", "factor": 0.0}}, "factor", ValueError),
    ({"rope_scaling": {**LLAMA3, "extra": 1}}, "extra", ValueError),
    ({"rope_scaling": {**LLAMA3, "high_freq_factor": 1.0}}, "high_freq_factor", ValueError),
    (
        {"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 8.5}},
        "original_max_position_embeddings",
        TypeError,
    ),
]


@pytest.mark.parametrize(("overrides", "field", "error"), BAD)
def test_errors_name_the_field(overrides, field, error):
    with raises_naming(field, error=error):
        DecoderConfig(**{**BASE, **overrides})
    with own_checks(), raises_naming(field, error=error):
        DecoderConfig(**{**BASE, **overrides})


def test_config_is_static_under_nnx_jit():
    """Models built from equal configs share one compilation: the config hashes by value."""
    traces = []

    @nnx.jit
    def run(model, tokens):
        traces.append(None)
        return model(tokens)

    tokens = jnp.zeros((1, 3), jnp.int32)
    first = run(Decoder(make_config(rope_scaling=dict(LLAMA3)), rngs=nnx.Rngs(0)), tokens)
    second = run(Decoder(make_config(rope_scaling=dict(LLAMA3)), rngs=nnx.Rngs(1)), tokens)
    assert not jnp.allclose(first, second)
    assert len(traces) == 1
    run(Decoder(make_config(rope_scaling=None), rngs=nnx.Rngs(0)), tokens)
    assert len(traces) == 2
