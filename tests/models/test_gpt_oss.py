"""gpt-oss: its config fields read or refused, YaRN against transformers, attention sinks, the
clamped SwiGLU, routing against transformers, stacked layers, expert parallelism. Logits,
greedy tokens and saving are in `test_hf_checkpoint.test_matches_transformers[gpt_oss]`."""

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests._helpers import raises_naming
from tests._hf import hf_modules, model_class, undocumented_config_fields, write_tiny_checkpoint
from tests.models.test_kv_cache import TOKENS, WHERE
from tests.models.test_moe import expert_parallel_equals_one_device
from tunelib.formats import config_from_hf, config_to_hf, load_hf_checkpoint
from tunelib.models import Decoder, DecoderConfig, rope_frequencies
from tunelib.models._moe import clamped_swiglu

DOCS = Path(__file__).parents[2] / "docs" / "models.md"
# A tiny gpt-oss: a sliding (window 3) and a full layer, sinks, 4 biased experts, top 2.
CONFIG = dict(
    vocab_size=40,
    hidden_size=32,
    intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    layer_types=["sliding_attention", "full_attention"],
    sliding_window=3,
    attention_bias=True,
    o_proj_bias=True,
    attention_sinks=True,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    norm_topk_prob=True,
    biased_experts=True,
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
    initializer_range=0.2,
)
HF_BASE = {
    "model_type": "gpt_oss",
    "vocab_size": 40,
    "hidden_size": 32,
    "intermediate_size": 16,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def test_every_gpt_oss_config_field_is_documented():
    """docs/models.md's gpt-oss table names each field of `GptOssConfig` with what the decoder
    does with it, so a field transformers adds fails here until it is read or refused."""
    missing = undocumented_config_fields("GptOssConfig", DOCS, "gpt-oss")
    assert not missing, missing


def test_defaults_and_the_round_trip():
    """A config.json with transformers' defaults: alternating layers from a sliding one,
    window 128, YaRN (factor 32 over 4096 positions, not truncated) on base 150000."""
    config = config_from_hf(HF_BASE)
    assert config.layer_types == ("sliding_attention", "full_attention") * 2
    assert config.sliding_window == 128 and config.rope_theta == 150_000.0
    assert config.rope_scaling == {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 4096,
        "truncate": False,
        "attention_factor": 0.1 * math.log(32) + 1,
    }
    assert (config.num_experts, config.num_experts_per_tok) == (128, 4)
    assert config.moe_intermediate_size == 16 and config.rms_norm_eps == 1e-5
    assert config.attention_bias and config.o_proj_bias and config.attention_sinks
    assert (config.swiglu_alpha, config.swiglu_limit) == (1.702, 7.0)
    ours = DecoderConfig(**CONFIG)
    written = json.loads(json.dumps(config_to_hf(ours, model_type="gpt_oss")))
    assert written["num_local_experts"] == 4 and written["intermediate_size"] == 16
    assert config_from_hf(written) == ours
    with raises_naming("gpt_oss", "moe_intermediate_size"):
        config_to_hf(DecoderConfig(**{**CONFIG, "moe_intermediate_size": 8}), model_type="gpt_oss")
    with raises_naming("qwen3_moe", "attention_sinks"):
        config_to_hf(DecoderConfig(**{**CONFIG, "layer_types": None}), model_type="qwen3_moe")


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("layer_types", ["sliding_attention", "chunked_attention"] * 2, "layer_types"),
        ("attention_dropout", 0.1, "attention_dropout"),
        ("rope_parameters", {"rope_type": "longrope", "factor": 2.0}, "longrope"),
        ("rope_parameters", {"rope_type": "yarn", "factor": 2.0, "alpha": 1.0}, "alpha"),
        ("rope_parameters", {"rope_type": "yarn", "factor": 2.0, "truncate": "no"}, "truncate"),
        ("quantization_config", {"quant_method": "mxfp4"}, "quantization_config"),
        ("sliding_window", None, "sliding_window"),
        ("attention_bias", "yes", "attention_bias"),
    ],
)
def test_unsupported_gpt_oss_fields_are_named(field, value, named):
    with raises_naming(named):
        config_from_hf({**HF_BASE, field: value})


def test_config_errors_name_the_field():
    with raises_naming("swiglu_alpha"):
        DecoderConfig(**{**CONFIG, "swiglu_alpha": None})
    with raises_naming("swiglu_limit"):
        DecoderConfig(**{**CONFIG, "biased_experts": False})
    with raises_naming("norm_topk_prob"):
        DecoderConfig(**{**CONFIG, "norm_topk_prob": False})
    with raises_naming("biased_experts", "num_experts"):
        DecoderConfig(**{**CONFIG, "num_experts": 0})
    with raises_naming("rope_scaling"):
        DecoderConfig(**CONFIG, rope_scaling={"rope_type": "yarn", "factor": 4.0})


@pytest.mark.parametrize(
    "rope",
    [
        {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096, "rope_theta": 150_000.0},
        {"factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4},
        {"factor": 8.0, "original_max_position_embeddings": 512, "rope_theta": 1e4,
         "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16.0},
    ],
)  # fmt: skip
def test_yarn_equals_transformers(rope):
    """Frequencies and attention factor equal transformers' (truncated or not, with its
    defaults, with `mscale`), as read from a config.json."""
    torch, transformers = hf_modules()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    parameters = {"rope_type": "yarn", **rope}
    # The context the factor extends the original one to (else transformers warns).
    context = int(rope["factor"] * rope["original_max_position_embeddings"])
    hf = {**HF_BASE, "head_dim": 16, "max_position_embeddings": context}
    theirs = transformers.GptOssConfig(**hf, rope_parameters=parameters)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](theirs)
    ours = config_from_hf({**hf, "rope_parameters": parameters})
    got = rope_frequencies(16, theta=ours.rope_theta, scaling=ours.rope_scaling)
    np.testing.assert_allclose(got, inv_freq.to(torch.float64).numpy(), rtol=2e-7)
    assert ours.rope_scaling["attention_factor"] == pytest.approx(attention_factor, rel=1e-12)
    # The ramp falls inside the head: some pairs are kept, some interpolated.
    plain = rope_frequencies(16, theta=ours.rope_theta)
    assert np.isclose(got, plain).any() and np.isclose(got, plain / rope["factor"]).any()


def test_clamped_swiglu_equals_its_formula():
    gate = np.linspace(-10, 10, 41)
    up = np.linspace(9, -9, 41)
    got = clamped_swiglu(jnp.asarray(gate), jnp.asarray(up), alpha=1.702, limit=7.0)
    g, u = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
    want = (u + 1) * g / (1 + np.exp(-1.702 * g))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_sinks_join_the_softmax_denominator_only():
    """Sinks at -1e30 give the model without sinks; at 0 the outputs change."""
    graphdef, state = nnx.split(Decoder(DecoderConfig(**CONFIG), rngs=nnx.Rngs(0)))
    pure = nnx.to_pure_dict(state)
    config = DecoderConfig(**{**CONFIG, "attention_sinks": False})
    graphdef0, state0 = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    plain = jax.tree.map(lambda x: x, pure)
    for layer in plain["layers"].values():
        del layer["self_attn"]["sinks"]
    nnx.replace_by_pure_dict(state0, plain)

    def run(graphdef):
        return jax.jit(lambda state: nnx.merge(graphdef, state)(TOKENS, where=WHERE))

    expected = run(graphdef0)(state0)
    with_sinks = run(graphdef)

    def hidden(sink_value):
        for layer in pure["layers"].values():
            layer["self_attn"]["sinks"] = jnp.full((4,), sink_value, jnp.float32)
        nnx.replace_by_pure_dict(state, pure)
        return np.where(WHERE[..., None], with_sinks(state), 0)

    expected = np.where(WHERE[..., None], expected, 0)
    np.testing.assert_allclose(hidden(-1e30), expected, rtol=1e-6, atol=1e-6)
    assert np.abs(hidden(0.0) - expected).max() > 1e-2


def test_routing_and_stacked_layers_match_transformers(tmp_path):
    """Router logits (with their bias) and each token's experts equal transformers'; the
    checkpoint loaded with stacked layers (one sliding and one full kind) gives the same
    logits as unstacked."""
    torch, _ = hf_modules()
    directory = write_tiny_checkpoint(tmp_path / "hf", "gpt_oss", tokenizer=False)
    reference = model_class("gpt_oss").from_pretrained(directory).eval()
    tokens = np.random.default_rng(0).integers(4, 300, size=(3, 9))
    where = np.ones(tokens.shape, bool)
    where[0, :3] = False
    loaded = load_hf_checkpoint(directory)
    run = jax.jit(
        lambda params: nnx.merge(loaded.graphdef, params)(
            tokens, where=where, return_router_logits=True, return_routing=True
        )
    )
    hidden, router_logits, routing = run(loaded.params)
    with torch.no_grad():
        out = reference(
            input_ids=torch.tensor(np.where(where, tokens, 0)),
            attention_mask=torch.tensor(where.astype(np.int64)),
            output_router_logits=True,
        )
    assert len(out.router_logits) == router_logits.shape[0] == 2
    for ours, chosen, theirs in zip(router_logits, routing, out.router_logits, strict=True):
        theirs = theirs.numpy().reshape(3, 9, -1)
        assert np.abs(np.asarray(ours) - theirs)[where].max() < 1e-5
        ranked = -np.sort(-theirs, axis=-1)[where]
        assert np.min(ranked[:, 1] - ranked[:, 2]) > 1e-4  # no near tie
        their_chosen = torch.topk(torch.tensor(theirs), 2).indices.numpy()
        np.testing.assert_array_equal(np.asarray(chosen)[where], their_chosen[where])
    stacked = load_hf_checkpoint(directory, scan_layers=True)
    scanned = jax.jit(lambda params: nnx.merge(stacked.graphdef, params)(tokens, where=where))
    scanned = scanned(stacked.params)
    np.testing.assert_allclose(np.asarray(scanned)[where], np.asarray(hidden)[where],
                               rtol=1e-5, atol=1e-5)  # fmt: skip


def test_expert_parallel_sharding_equals_one_device():
    """8 devices: the biased experts over "expert" (4), widths over "model" (2), in float64
    (as the other families' tests); every weight, sinks and biases included, gets a
    gradient."""
    with jax.enable_x64(True):
        config = DecoderConfig(**CONFIG, dtype="float64", param_dtype="float64")
        graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
        grads = expert_parallel_equals_one_device(
            graphdef, params, TOKENS,
            lambda s: s["layers"][0]["mlp"]["experts"]["gate_up_proj"]["kernel"],
            rtol=1e-10, atol=1e-12,
        )  # fmt: skip
    for path, grad in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads)):
        assert np.asarray(grad).any(), jax.tree_util.keystr(path)
