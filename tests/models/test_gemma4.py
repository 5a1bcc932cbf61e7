"""Gemma 4: its config fields read or refused, KV sharing and the cache, proportional RoPE,
routing against transformers, expert parallelism. Logits, greedy tokens and saving are in
`test_hf_checkpoint.test_matches_transformers[gemma4_text*]`."""

import dataclasses
import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests._helpers import assert_within_float32_rounding, raises_naming, x64_copies
from tests._hf import hf_modules, model_class, write_tiny_checkpoint
from tests.models.test_kv_cache import TOKENS, WHERE, cached_hidden
from tests.models.test_moe import expert_parallel_equals_one_device
from tunelib.formats import config_from_hf, config_to_hf, load_hf_checkpoint
from tunelib.models import Decoder, DecoderConfig, rope_frequencies, route

DOCS = Path(__file__).parents[2] / "docs" / "models.md"
# A dense Gemma 4 with every feature on: sliding (window 3) and wider full layers with one
# key/value head that is also the value, proportional RoPE, the last two layers sharing keys
# and values with double-wide MLPs, per-layer inputs.
DENSE = dict(
    vocab_size=40,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=5,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    global_head_dim=16,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    layer_types=[
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ],
    sliding_window=3,
    rope_theta=1e4,
    rope_scaling={"rope_type": "proportional", "factor": 1.0, "partial_rotary_factor": 0.5},
    rope_local_base_freq=100.0,
    num_kv_shared_layers=2,
    use_double_wide_mlp=True,
    hidden_size_per_layer_input=4,
    query_pre_attn_scalar=1.0,
    use_qk_norm=True,
    value_norm=True,
    sandwich_norms=True,
    scale_embeddings=True,
    layer_scalars=True,
    tie_word_embeddings=True,
    hidden_act="gelu_pytorch_tanh",
    final_logit_softcapping=5.0,
    initializer_range=0.2,
)
MOE = dict(DENSE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=8,
           norm_topk_prob=True, parallel_moe=True)  # fmt: skip


def test_layers_share_keys_and_values_and_the_cache_has_one_array_per_shape():
    config = DecoderConfig(**DENSE)
    assert config.kv_sources == (0, 1, 2, 2, 1)
    assert config.layer_head_dims == (8, 16, 8, 8, 16)
    assert config.layer_kv_heads == (2, 1, 2, 2, 1)
    model = Decoder(config, rngs=nnx.Rngs(0))
    attention = [layer.self_attn for layer in model.layers]
    assert [a.shares_kv for a in attention] == [False, False, False, True, True]
    assert attention[1].v_proj is None and attention[0].v_proj is not None
    assert not hasattr(attention[3], "k_proj")
    widths = [layer.mlp.up_proj.kernel.shape[1] for layer in model.layers]
    assert widths == [48, 48, 48, 96, 96]
    cache = model.init_cache(3, 10)
    assert [k.shape for k in cache.keys] == [(2, 3, 2, 10, 8), (1, 3, 1, 10, 16)]
    assert [x.shape for x in cache.values] == [k.shape for k in cache.keys]


def test_cached_decoding_equals_the_full_forward():
    """Prefill 5 columns, then one at a time: the window (3) slides past the prompt, and the
    shared layers read the producers' cache slots. (Experts decode in the greedy parity
    test of `test_hf_checkpoint`.)

    The cached steps sum in another order than the full forward, so the two agree only to
    float32 rounding, whose size depends on the CPU. It is measured here: the full forward's
    distance from the same weights' float64 forward. The cached steps must be as close to
    float64, within a factor 4 (here they are within 1.1). Cached decoding itself does not run
    in float64 (under x64 its cache index and slice starts mix int32 and int64)."""
    model = Decoder(DecoderConfig(**DENSE), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    hidden, cache = cached_hidden(model, TOKENS, WHERE, prefill=5, slots=12)
    expected = jax.jit(lambda s, t, w: nnx.merge(graphdef, s)(t, where=w))(state, TOKENS, WHERE)
    tokens, where = x64_copies(TOKENS, WHERE)
    with jax.enable_x64(True):
        config = DecoderConfig(**DENSE, dtype="float64", param_dtype="float64")
        graphdef64, state64 = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
        pure = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), nnx.to_pure_dict(state))
        nnx.replace_by_pure_dict(state64, pure)
        run = jax.jit(lambda s, t, w: nnx.merge(graphdef64, s)(t, where=w))
        exact = np.asarray(run(state64, tokens, where))
    assert exact.dtype == np.float64
    mask = WHERE[..., None]
    assert_within_float32_rounding(
        np.where(mask, hidden, 0), np.where(mask, expected, 0), np.where(mask, exact, 0)
    )
    assert int(cache.index) == 10


def test_proportional_rope_equals_its_formula():
    """The first floor(p D / 2) pairs rotate at theta^(-2i/D) / s, the rest not at all."""
    for head_dim, partial, factor in [(16, 0.25, 1.0), (12, 0.5, 2.0), (8, 1.0, 4.0)]:
        scaling = {"rope_type": "proportional", "factor": factor, "partial_rotary_factor": partial}
        got = rope_frequencies(head_dim, theta=1e4, scaling=scaling)
        rotated = int(partial * head_dim) // 2
        want = np.zeros(head_dim // 2)
        for i in range(rotated):
            want[i] = 1e4 ** (-2 * i / head_dim) / factor
        np.testing.assert_allclose(got, want, rtol=1e-15)


def test_config_errors_name_the_field():
    with raises_naming("num_kv_shared_layers"):
        DecoderConfig(**{**DENSE, "num_kv_shared_layers": 5})
    with raises_naming("num_kv_shared_layers", "layer 2"):
        DecoderConfig(**{**DENSE, "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 3,
                         "num_kv_shared_layers": 3})  # fmt: skip
    with raises_naming("vocab_size_per_layer_input"):
        DecoderConfig(**DENSE, vocab_size_per_layer_input=50)
    with raises_naming("parallel_moe"):
        DecoderConfig(**DENSE, parallel_moe=True)
    with raises_naming("partial_rotary_factor"):
        DecoderConfig(
            **{**DENSE, "rope_scaling": {**DENSE["rope_scaling"], "partial_rotary_factor": 1.5}}
        )
    with raises_naming("scan_layers"):
        DecoderConfig(**{**DENSE, "hidden_size_per_layer_input": 0}, scan_layers=True)
    with raises_naming("num_global_key_value_heads"):
        DecoderConfig(**{**DENSE, "num_global_key_value_heads": 3})
    with raises_naming("global_head_dim"):
        DecoderConfig(**{**DENSE, "global_head_dim": 7})


def _gemma4_fields() -> list[str]:
    """Every field of transformers' `Gemma4TextConfig`, and the ones its constructor pops."""
    _, transformers = hf_modules()
    fields = [f.name for f in dataclasses.fields(transformers.Gemma4TextConfig)]
    own = [f for f in fields if f in transformers.Gemma4TextConfig.__annotations__]
    return [*own, "global_head_dim", "num_global_key_value_heads", "per_layer_config"]


def test_every_gemma4_config_field_is_documented():
    """docs/models.md's Gemma 4 table names each field with what the decoder does with it."""
    text = DOCS.read_text()
    section = text[text.index("\n## Gemma 4\n") + 1 :]
    section = section[: section.index("\n## ")]
    missing = [f for f in _gemma4_fields() if not re.search(rf"`{f}`", section)]
    assert not missing, missing


HF_BASE = {
    "model_type": "gemma4_text",
    "vocab_size": 40,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "hidden_size_per_layer_input": 4,
    "vocab_size_per_layer_input": 40,
}


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("use_bidirectional_attention", "all", "use_bidirectional_attention"),
        ("hidden_activation", "relu", "hidden_activation"),
        ("attention_dropout", 0.1, "attention_dropout"),
        ("vocab_size_per_layer_input", 64, "vocab_size_per_layer_input"),
        ("per_layer_config", {"0": {"head_dim": 16}}, "per_layer_config"),
        ("per_layer_config", {"1": {"intermediate_size": 16}}, "intermediate_size"),
        ("enable_moe_block", True, "num_experts"),
        ("attention_k_eq_v", "yes", "attention_k_eq_v"),
        (
            "rope_parameters",
            {"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            "sliding_attention",
        ),
        ("quantization_config", {"quant_method": "fp8"}, "quantization_config"),
    ],
)
def test_unsupported_gemma4_fields_are_named(field, value, named):
    with raises_naming(named):
        config_from_hf({**HF_BASE, field: value})


def test_gemma4_defaults_both_layouts_and_the_round_trip():
    """A config.json with transformers' defaults; the released checkpoints' top-level
    `global_head_dim` equals the `per_layer_config` current transformers writes."""
    config = config_from_hf(HF_BASE)
    assert config.layer_types == ("sliding_attention", "full_attention")  # last forced full
    assert config.global_head_dim == 512 and config.num_global_key_value_heads is None
    assert config.rope_scaling == {"rope_type": "proportional", "factor": 1.0,
                                   "partial_rotary_factor": 0.25}  # fmt: skip
    assert config.rope_theta == 1e6 and config.rope_local_base_freq == 1e4
    assert config.sliding_window == 512 and config.query_pre_attn_scalar == 1.0
    released = {**HF_BASE, "global_head_dim": 16, "num_global_key_value_heads": 1,
                "attention_k_eq_v": True}  # fmt: skip
    current = {**HF_BASE, "attention_k_eq_v": True,
               "per_layer_config": {"1": {"head_dim": 16, "num_key_value_heads": 1}}}  # fmt: skip
    assert config_from_hf(released) == config_from_hf(current)
    for fields in (DENSE, MOE):
        ours = DecoderConfig(**fields)
        written = json.loads(json.dumps(config_to_hf(ours, model_type="gemma4_text")))
        assert config_from_hf(written) == dataclasses.replace(ours, initializer_range=0.2)
    with raises_naming("gemma4_text", "norm_offset"):
        config_to_hf(DecoderConfig(**DENSE, norm_offset=True), model_type="gemma4_text")
    with raises_naming("gemma3_text", "norm_offset"):
        config_to_hf(DecoderConfig(**{**DENSE, "rope_scaling": None}), model_type="gemma3_text")
    with raises_naming("gemma3_text", "proportional"):
        config_to_hf(DecoderConfig(**DENSE), model_type="gemma3_text")


def test_gemma4_routing_matches_transformers(tmp_path):
    """Each token's router probabilities and chosen experts equal transformers' (which
    records the probabilities as its `router_logits`)."""
    torch, _ = hf_modules()
    directory = write_tiny_checkpoint(tmp_path / "hf", "gemma4_text_moe", tokenizer=False)
    reference = model_class("gemma4_text_moe").from_pretrained(directory).eval()
    loaded = load_hf_checkpoint(directory)
    tokens = np.random.default_rng(0).integers(4, 300, size=(3, 9))
    where = np.ones(tokens.shape, bool)
    where[0, :3] = False
    model = nnx.merge(loaded.graphdef, loaded.params)
    _, router_logits = model(tokens, where=where, return_router_logits=True)
    with torch.no_grad():
        out = reference(
            input_ids=torch.tensor(np.where(where, tokens, 0)),
            attention_mask=torch.tensor(where.astype(np.int64)),
            output_router_logits=True,
        )
    assert len(out.router_logits) == router_logits.shape[0] == 2
    for ours, theirs in zip(router_logits, out.router_logits, strict=True):
        theirs = theirs.numpy().reshape(3, 9, -1)
        probs = np.asarray(jax.nn.softmax(ours, axis=-1))
        assert np.abs(probs - theirs)[where].max() < 1e-5
        # No near tie that float32 rounding could route either way: the second and third
        # probabilities are further apart than twice their distance to transformers'.
        ranked = -np.sort(-probs, axis=-1)[where]
        assert np.min(ranked[:, 1] - ranked[:, 2]) > 2e-5
        chosen = np.asarray(route(ours, top_k=2)[1])
        their_chosen = torch.topk(torch.tensor(theirs), 2).indices.numpy()
        np.testing.assert_array_equal(chosen[where], their_chosen[where])


def test_expert_parallel_sharding_equals_one_device_and_layer_scalars_take_no_gradient():
    """8 devices: Gemma 4's fused experts over "expert" (4), widths over "model" (2). In
    float64, so that the comparison is exact to rounding: in float32 both runs are about
    1e-4 from the float64 gradients here, in different places. Every weight but the layer
    scalars (buffers in transformers) gets a gradient."""
    # Two layers (a sliding and a wider full one) keep the float64 compilation short.
    fields = {**MOE, "num_hidden_layers": 2, "layer_types": DENSE["layer_types"][:2],
              "num_kv_shared_layers": 0}  # fmt: skip
    with jax.enable_x64(True):
        config = DecoderConfig(**fields, dtype="float64", param_dtype="float64")
        graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
        grads = expert_parallel_equals_one_device(
            graphdef, params, TOKENS,
            lambda s: s["layers"][0]["experts"]["gate_up_proj"]["kernel"],
            rtol=1e-10, atol=1e-12,
        )  # fmt: skip
    for path, grad in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads)):
        name = jax.tree_util.keystr(path)
        assert np.asarray(grad).any() != ("layer_scalar" in name), name
