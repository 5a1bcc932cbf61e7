"""Layers of several shapes scanned by groups (`scan_layers=True`, `DecoderConfig.layer_runs`):
the runs chosen, and the same numbers as the unrolled layers in the forward pass, the
completion log-probs and their gradients, the KV caches (full and windowed), the decoding
layout, the sampler, Hugging Face save and load, LoRA and the sharding names."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tests._helpers import raises_naming
from tests.models.test_deepseek import CONFIG as DEEPSEEK
from tests.models.test_gemma4 import DENSE
from tunelib import peft
from tunelib.formats import load_hf_checkpoint, read_peft_lora, save_hf_checkpoint
from tunelib.models import Decoder, DecoderConfig, param_shardings
from tunelib.models._layer_runs import LayerRun, layer_runs
from tunelib.rollout import SamplingConfig, completion_logps, sample

S, F = "sliding_attention", "full_attention"
# Gemma 4 with its two widths of layer (and keys that are the values in the full ones): a
# pattern of two layers repeated twice and one full layer left over, 3 layer bodies for 5.
GEMMA4 = {
    **{k: v for k, v in DENSE.items() if k not in ("num_kv_shared_layers", "use_double_wide_mlp")},
    "hidden_size_per_layer_input": 0,
    "layer_types": [S, F, S, F, F],
}
# Qwen3-MoE with a dense layer then two mixture-of-experts ones, twice (DeepSeek-V3's dense
# first layers are a prefix): the router logits come out of the stacks in layer order.
QWEN3_MOE = dict(
    vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=6,
    num_attention_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=12, norm_topk_prob=True, use_qk_norm=True, mlp_only_layers=[0, 3],
    initializer_range=0.2,
)  # fmt: skip
PROMPTS = np.array([[0, 3, 4, 9, 11], [5, 6, 7, 8, 1]])
PROMPT_WHERE = np.array([[False, True, True, True, True], [True] * 5])
COMPLETIONS = np.array([[2, 8, 13, 5, 0, 0], [7, 1, 1, 9, 4, 3]])
COMPLETION_WHERE = COMPLETIONS != 0


def stacked(layers: dict, config: DecoderConfig):
    """The unrolled `layers` (a pure dict or adapters, keyed by layer) as `config` stacks
    them."""
    stacks = [
        jax.tree.map(lambda *xs: jnp.stack(xs), *[layers[i] for i in members])
        for members in config.layer_stacks
    ]
    return stacks[0] if len(stacks) == 1 else dict(enumerate(stacks))


def grouped(unrolled: Decoder, **options) -> Decoder:
    """The model scanned by groups with `unrolled`'s weights, each stack made of its layers."""
    config = dataclasses.replace(unrolled.config, scan_layers=True, **options)
    model = nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0)))
    pure = nnx.to_pure_dict(nnx.state(unrolled, nnx.Param))
    pure["layers"] = stacked(pure["layers"], config)
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, pure)
    nnx.update(model, state)
    return model


def pair(fields: dict) -> tuple[Decoder, Decoder]:
    unrolled = Decoder(DecoderConfig(**fields), rngs=nnx.Rngs(1))
    return unrolled, grouped(unrolled)


def test_the_runs_compile_a_fixed_number_of_layer_bodies():
    gemma4 = [S] * 5 + [F]
    assert layer_runs(gemma4 * 4 + [S, F]) == (LayerRun(0, 6, 4), LayerRun(24, 2, 1))
    assert layer_runs(gemma4 * 10) == (LayerRun(0, 6, 10),)
    assert layer_runs(["dense"] * 3 + ["moe"] * 58) == (LayerRun(0, 3, 1), LayerRun(3, 1, 58))
    assert layer_runs("abab" * 3 + "a") == (LayerRun(0, 2, 6), LayerRun(12, 1, 1))
    assert layer_runs("aaa") == (LayerRun(0, 1, 3),)
    config = DecoderConfig(**GEMMA4, scan_layers=True)
    assert config.layer_runs == (LayerRun(0, 2, 2), LayerRun(4, 1, 1))
    assert config.layer_stacks == ((0, 2), (1, 3), (4,))
    assert DecoderConfig(**QWEN3_MOE).layer_stacks == ((0, 3), (1, 4), (2, 5))
    # Layers of one shape keep their single stack, of both kinds (Gemma 2 and 3).
    same = DecoderConfig(**{**GEMMA4, "global_head_dim": None, "num_global_key_value_heads": None,
                            "attention_k_eq_v": False})  # fmt: skip
    assert same.layer_runs == (LayerRun(0, 1, 5),) and same.layer_stacks == (tuple(range(5)),)


def test_what_the_groups_cannot_scan_is_refused_by_name():
    with raises_naming("scan_layers", "num_kv_shared_layers"):
        DecoderConfig(**GEMMA4, num_kv_shared_layers=2, scan_layers=True)
    with raises_naming("scan_layers", "hidden_size_per_layer_input"):
        DecoderConfig(**{**GEMMA4, "hidden_size_per_layer_input": 4}, scan_layers=True)
    assert DecoderConfig(**GEMMA4).stackable
    assert not DecoderConfig(**GEMMA4, num_kv_shared_layers=2).stackable


def test_the_groups_give_the_unrolled_logps_and_gradients():
    """In float32: the stacks (here rematerialised) run the same products as the loop, in
    another program, so the log-probs agree to 1e-5 and the gradients to 1e-4 of their
    largest."""
    unrolled = Decoder(DecoderConfig(**GEMMA4), rngs=nnx.Rngs(1))
    scanned = grouped(unrolled, remat=True)
    assert len(scanned.layers) == len(scanned.config.layer_stacks)

    def loss(graphdef, params):
        logps = completion_logps(graphdef, params, PROMPTS, PROMPT_WHERE, COMPLETIONS,
                                 COMPLETION_WHERE, share_prompts=False)  # fmt: skip
        return logps.sum(), logps

    results = []
    for model in (unrolled, scanned):
        graphdef, params = nnx.split(model, nnx.Param)
        run = jax.jit(jax.value_and_grad(loss, argnums=1, has_aux=True), static_argnums=0)
        (_, logps), grads = run(graphdef, params)
        results.append((logps, nnx.to_pure_dict(grads)))
    (logps, grads), (scan_logps, scan_grads) = results
    np.testing.assert_allclose(scan_logps, logps, atol=1e-5, rtol=0)
    for s, members in enumerate(scanned.config.layer_stacks):
        stacked = jax.tree.map(lambda *g: np.stack(g), *[grads["layers"][i] for i in members])
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(b).max()),
            scan_grads["layers"][s],
            stacked,
        )


def test_router_logits_come_in_layer_order_and_the_sampler_replays_the_forward():
    """The stacks give the unrolled router logits (to 1e-5), in layer order; greedy sampling
    picks the forward pass's argmax at every step and records its routing."""
    unrolled, scanned = pair(QWEN3_MOE)
    forward = jax.jit(lambda m, t, w: m(t, w, return_router_logits=True, return_routing=True))
    _, logits, _ = forward(unrolled, PROMPTS, PROMPT_WHERE)
    _, scan_logits, _ = forward(scanned, PROMPTS, PROMPT_WHERE)
    assert scan_logits.shape == (4, 2, 5, 4)  # layers 1, 2, 4, 5
    np.testing.assert_allclose(scan_logits, logits, atol=1e-5, rtol=0)
    config = SamplingConfig(max_new_tokens=4, temperature=0.0, cache_length=10)
    graphdef, params = nnx.split(scanned)
    out = sample(graphdef, params, PROMPTS, PROMPT_WHERE, jax.random.key(0), config,
                 record_routing=True)  # fmt: skip
    assert out.where.all()  # no stop token: every column is a real token
    tokens = np.concatenate([PROMPTS, out.tokens], axis=1)
    where = np.concatenate([PROMPT_WHERE, out.where], axis=1)
    hidden, _, routing = forward(scanned, tokens, where)
    greedy = np.argmax(scanned.unembed(hidden), axis=-1)
    np.testing.assert_array_equal(out.tokens, greedy[:, 4:-1])
    real = where[:, :-1]  # the last token is sampled, never fed back
    recorded = np.moveaxis(np.asarray(out.routing), 2, 0)[:, :, :-1]  # [M, B, T, k]
    np.testing.assert_array_equal(recorded[:, real], np.asarray(routing)[:, :, :-1][:, real])


def test_deepseek_dense_prefix_and_latent_cache():
    """DeepSeek-V3's dense first layer is an unrolled prefix before the stack of its MoE
    layers; a prefill into the latent cache equals the unrolled one."""
    unrolled, scanned = pair(DEEPSEEK)
    assert scanned.config.layer_runs == (LayerRun(0, 1, 1), LayerRun(1, 1, 2))
    prefill = jax.jit(lambda m: m.extend(PROMPTS, PROMPT_WHERE, m.init_cache(2, 6)))
    (hidden, cache), (want, want_cache) = prefill(scanned), prefill(unrolled)
    np.testing.assert_allclose(hidden, want, atol=1e-5)
    np.testing.assert_allclose(cache.keys[0], want_cache.keys[0], atol=1e-5)  # the latents


def test_cached_decoding_and_the_decoding_layout_equal_the_unrolled_cache():
    """One column at a time past the window (3): the unrolled model's full cache, the
    groups' full and windowed caches, and the groups' in the decoding layout give the same
    hidden states (the layout bit for bit)."""
    unrolled, scanned = pair(GEMMA4)
    graphdef, state = nnx.split(scanned)
    per_layer = nnx.merge(graphdef, scanned.decoding_layout(nnx.to_pure_dict(state)))
    tokens = np.concatenate([PROMPTS, COMPLETIONS[:, :3]], axis=1)
    where = np.concatenate([PROMPT_WHERE, COMPLETION_WHERE[:, :3]], axis=1)
    step = jax.jit(lambda model, t, w, cache: model.extend(t, w, cache))
    outs = []
    for model, windowed in ((unrolled, False), (scanned, False), (scanned, True),
                            (per_layer, True)):  # fmt: skip
        cache = model.init_cache(2, 10, windowed=windowed)
        pieces = []
        for t in range(tokens.shape[1]):
            hidden, cache = step(model, tokens[:, t : t + 1], where[:, t : t + 1], cache)
            pieces.append(hidden)
        outs.append((np.concatenate(pieces, axis=1), cache))
    (hidden, cache), (full, full_cache), (ring, ring_cache), (layout, _) = outs
    assert [k.shape for k in full_cache.keys] == [k.shape for k in cache.keys]
    assert [k.shape[3] for k in ring_cache.keys] == [3, 10]  # the sliding layers' ring
    for k, want in zip(full_cache.keys + full_cache.values, cache.keys + cache.values,
                       strict=True):  # fmt: skip
        np.testing.assert_allclose(k, want, atol=1e-5)
    np.testing.assert_array_equal(layout, ring)
    mask = where[..., None]
    for got in (full, ring):
        np.testing.assert_allclose(np.where(mask, got, 0), np.where(mask, hidden, 0), atol=1e-5)


def test_a_grouped_model_saves_and_loads_the_unrolled_checkpoint(tmp_path):
    unrolled, scanned = pair(GEMMA4)
    hf = {"model_type": "gemma4_text"}
    save_hf_checkpoint(tmp_path / "scanned", *nnx.split(scanned), hf_config=hf)
    save_hf_checkpoint(tmp_path / "unrolled", *nnx.split(unrolled), hf_config=hf)
    for a, b in (("scanned", "model.safetensors"), ("unrolled", "model.safetensors")):
        assert (tmp_path / a / b).exists()
    loaded = load_hf_checkpoint(tmp_path / "unrolled", scan_layers=True)
    back = load_hf_checkpoint(tmp_path / "scanned")
    assert loaded.config.layer_stacks == scanned.config.layer_stacks
    expected = nnx.to_pure_dict(nnx.state(scanned, nnx.Param))
    jax.tree.map(np.testing.assert_array_equal, loaded.params, expected)
    jax.tree.map(np.testing.assert_array_equal, back.params,
                 nnx.to_pure_dict(nnx.state(unrolled, nnx.Param)))  # fmt: skip


def test_lora_on_the_stacks_equals_lora_on_the_layers_and_every_stack_is_sharded(tmp_path):
    unrolled, scanned = pair(GEMMA4)
    rules = [peft.LoraRule(pattern=r"layers/.*self_attn/.*_proj/kernel", rank=2)]
    params = nnx.to_pure_dict(nnx.state(unrolled, nnx.Param))
    adapters = peft.init_lora(params, rules, key=jax.random.key(0))
    adapters = jax.tree.map(lambda x: x + 0.1, adapters)  # B != 0
    scanned_adapters = {"layers": stacked(adapters["layers"], scanned.config)}
    for s, members in enumerate(scanned.config.layer_stacks):
        lora_a = scanned_adapters["layers"][s]["self_attn"]["o_proj"]["kernel"].a
        assert lora_a.shape[0] == len(members)

    def hidden(model, adapters):
        graphdef, params = nnx.split(model, nnx.Param)
        params = peft.apply_lora(nnx.to_pure_dict(params), adapters)
        run = peft.lora(lambda params: nnx.merge(graphdef, params)(PROMPTS, PROMPT_WHERE))
        return jax.jit(run)(params)

    got, want = hidden(scanned, scanned_adapters), hidden(unrolled, adapters)
    assert np.abs(want - hidden(unrolled, jax.tree.map(jnp.zeros_like, adapters))).max() > 0.1
    np.testing.assert_allclose(got, want, atol=1e-5)
    # A stack's path does not say which layers it holds: PEFT export needs layer_stacks, and
    # then writes the unrolled model's adapters, which import back into the stacks.
    scanned_params = nnx.to_pure_dict(nnx.state(scanned, nnx.Param))
    with raises_naming("layer_stacks"):
        peft.export_peft(tmp_path / "refused", scanned_adapters, scanned_params)
    stacks = scanned.config.layer_stacks
    peft.export_peft(tmp_path / "scanned", scanned_adapters, scanned_params, layer_stacks=stacks)
    peft.export_peft(tmp_path / "unrolled", adapters, params)
    written = [read_peft_lora(tmp_path / name) for name in ("scanned", "unrolled")]
    assert written[0][0] == written[1][0]  # the config, target modules included
    jax.tree.map(np.testing.assert_array_equal, written[0][1], written[1][1])
    back = peft.import_peft(tmp_path / "unrolled", scanned_params, layer_stacks=stacks)
    jax.tree.map(np.testing.assert_allclose, back, scanned_adapters)
    graphdef, state = nnx.split(scanned)
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    shardings = param_shardings(graphdef, nnx.to_pure_dict(state), mesh)
    for s in range(len(scanned.config.layer_stacks)):
        spec = shardings["layers"][s]["self_attn"]["q_proj"]["kernel"].spec
        assert spec == jax.sharding.PartitionSpec(None, None, "model")
