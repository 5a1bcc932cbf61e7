"""Gemma 3 beyond the shared parity test: stacked layers of two kinds, its config defaults,
and the config fields the decoder refuses."""

import json

import jax
import numpy as np
import pytest
from flax import nnx

from tests._helpers import raises_naming
from tests._hf import hf_logits, hf_modules, model_class, write_tiny_checkpoint
from tunelib.formats import config_from_hf, load_hf_checkpoint
from tunelib.models import DecoderConfig

TOKENS = np.random.default_rng(0).integers(4, 300, size=(2, 11))
WHERE = np.ones(TOKENS.shape, bool)
WHERE[0, :3] = False


def logits_of(loaded):
    def run(params, tokens, where):
        model = nnx.merge(loaded.graphdef, params)
        return model.unembed(model(tokens, where=where))

    return np.asarray(jax.jit(run)(loaded.params, TOKENS, WHERE))


def test_stacked_layers_of_two_kinds(tmp_path):
    """Three layers, sliding, full, sliding: transformers' logits, and stacked layers that
    pick each kind's window and RoPE per layer give the same."""
    hf_modules()
    directory = write_tiny_checkpoint(
        tmp_path / "hf", "gemma3_text", tokenizer=False, num_hidden_layers=3,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    )  # fmt: skip
    expected = hf_logits(model_class("gemma3_text").from_pretrained(directory), TOKENS, WHERE)
    loaded = load_hf_checkpoint(directory)
    assert loaded.config.sliding_layers == (True, False, True)
    ours = logits_of(loaded)
    assert np.abs(ours - expected)[WHERE].max() < 1e-4
    scanned = load_hf_checkpoint(directory, scan_layers=True)
    np.testing.assert_allclose(logits_of(scanned)[WHERE], ours[WHERE], rtol=1e-5, atol=1e-5)
    # The local RoPE matters: rotating the sliding layers as the full ones changes the logits.
    config = json.loads((directory / "config.json").read_text())
    config["rope_parameters"]["sliding_attention"]["rope_theta"] = 1e6
    (directory / "config.json").write_text(json.dumps(config))
    assert np.abs(logits_of(load_hf_checkpoint(directory)) - ours)[WHERE].max() > 1e-3


BASE = {
    "model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
}  # fmt: skip


def test_gemma3_config_defaults_and_older_layout():
    config = config_from_hf({**BASE, "num_hidden_layers": 7})
    # Every sixth layer is full (sliding_window_pattern 6), the rest slide over 4,096 slots.
    assert config.sliding_layers == (True,) * 5 + (False, True)
    assert (config.sliding_window, config.rope_theta, config.rope_local_base_freq) == (
        4096, 1e6, 1e4)  # fmt: skip
    assert config.query_pre_attn_scalar == 256 and config.tie_word_embeddings
    older = config_from_hf(
        {**BASE, "rope_theta": 5e5, "rope_local_base_freq": 2e4,
         "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    )  # fmt: skip
    assert (older.rope_theta, older.rope_local_base_freq) == (5e5, 2e4)
    assert older.rope_scaling == {"rope_type": "linear", "factor": 8.0}


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("use_bidirectional_attention", True, "use_bidirectional_attention"),
        ("attn_logit_softcapping", 50.0, "attn_logit_softcapping"),
        ("hidden_activation", "gelu", "hidden_activation"),
        ("layer_types", ["full_attention"], "layer_types"),
        ("rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "linear", "factor": 2.0}},
         "sliding_attention"),
    ],
)  # fmt: skip
def test_unsupported_gemma3_fields_are_named(field, value, named):
    with raises_naming(named):
        config_from_hf({**BASE, field: value})


def test_layer_types_need_a_window():
    with raises_naming("sliding_window"):
        DecoderConfig(**{k: v for k, v in BASE.items() if k != "model_type"},
                      layer_types=("sliding_attention", "full_attention"))  # fmt: skip
    with raises_naming("layer_types"):
        DecoderConfig(**{k: v for k, v in BASE.items() if k != "model_type"},
                      layer_types=("global", "full_attention"), sliding_window=4)  # fmt: skip


def test_gemma2_soft_caps_bind_and_reach_every_head(tmp_path):
    """Gemma 2's attention and final soft-caps both change the logits here, and the fused
    log-prob head of the rollout path applies the final one as `unembed` does."""
    from tunelib.logprobs import token_logps
    from tunelib.rollout import completion_logps

    hf_modules()
    directory = write_tiny_checkpoint(tmp_path / "hf", "gemma2", tokenizer=False)
    loaded = load_hf_checkpoint(directory)
    assert (loaded.config.attn_logit_softcapping, loaded.config.final_logit_softcapping) == (
        3.0, 4.0)  # fmt: skip
    capped = logits_of(loaded)
    assert np.abs(capped).max() < 4.0
    config = json.loads((directory / "config.json").read_text())
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        (directory / "config.json").write_text(json.dumps({**config, field: None}))
        assert np.abs(logits_of(load_hf_checkpoint(directory)) - capped)[WHERE].max() > 1e-2
    (directory / "config.json").write_text(json.dumps(config))
    prompt, completion = TOKENS[:, :6], TOKENS[:, 6:]
    ours = completion_logps(
        loaded.graphdef, loaded.params, prompt, WHERE[:, :6], completion, WHERE[:, 6:]
    )
    expected = token_logps(capped[:, 5:-1], completion)
    np.testing.assert_allclose(np.asarray(ours), np.asarray(expected), rtol=1e-5, atol=1e-5)


def test_gemma2_config_defaults():
    config = config_from_hf({**BASE, "model_type": "gemma2", "num_hidden_layers": 4})
    assert config.sliding_layers == (True, False, True, False)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert not config.use_qk_norm and config.rope_local_base_freq is None
