"""`Decoder.decoding_layout`: stacked layers whose dense weights are read in place, one array
per layer, compute exactly what the scan over the stacks computes, in every family that
stacks."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tunelib._products import plain_products
from tunelib.models import Decoder, DecoderConfig
from tunelib.models._per_layer import LayerWeight, PerLayer

BASE = dict(
    vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.3,
    scan_layers=True,
)  # fmt: skip
GEMMA = dict(sandwich_norms=True, norm_offset=True, scale_embeddings=True,
             hidden_act="gelu_pytorch_tanh")  # fmt: skip
# One tiny stackable config per family, with the features its layers differ by.
FAMILIES = {
    "llama": {},
    "qwen3": dict(use_qk_norm=True, tie_word_embeddings=True),
    "gemma2": dict(
        GEMMA, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        query_pre_attn_scalar=8, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    ),
    "gemma3": dict(
        GEMMA, use_qk_norm=True, sliding_window=4, rope_local_base_freq=1e4, rope_theta=1e6,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    ),
    "gemma4": dict(
        sandwich_norms=True, scale_embeddings=True, use_qk_norm=True, value_norm=True,
        layer_scalars=True, hidden_act="gelu_pytorch_tanh", final_logit_softcapping=5.0,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8, norm_topk_prob=True,
        parallel_moe=True,
    ),
    "qwen3_moe": dict(use_qk_norm=True, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=12, norm_topk_prob=True),
}  # fmt: skip
TOKENS = np.array([[0, 3, 4, 9, 11], [5, 6, 7, 8, 1]])
WHERE = np.array([[False, True, True, True, True], [True] * 5])


def family_model(name: str, **overrides) -> Decoder:
    return Decoder(DecoderConfig(**{**BASE, **FAMILIES[name], **overrides}), rngs=nnx.Rngs(1))


def decode(graphdef, state, per_layer: bool):
    """Prefill, three decode steps (one row padded at the second) and a full forward pass with
    its router logits, in the stacked layout or the decoding one."""
    run = nnx.merge(graphdef, state)
    if per_layer:
        run = nnx.merge(graphdef, run.decoding_layout(state))
    cache = run.init_cache(2, 9)
    hidden, cache = run.extend(TOKENS, WHERE, cache)
    outs = [hidden]
    for t in range(3):
        live = jnp.array([[True], [t != 1]])
        hidden, cache = run.extend(jnp.array([[t + 2], [t + 7]]), live, cache)
        outs.append(hidden)
    full, logits = run(TOKENS, WHERE, return_router_logits=True)
    return outs, cache, full, logits, run.unembed(hidden)


# The layout holds the `Dense` kernels one array per layer, the same way in every family: the
# families whose layers differ most (soft caps and two kinds of layer; two widths and shared
# keys; experts) stand for Llama, Qwen3 and Gemma 3, whose layers hold a subset of theirs.
@pytest.mark.parametrize("family", ["gemma2", "gemma4", "qwen3_moe"])
def test_decoding_reads_the_same_weights_and_gives_the_same_bits(family):
    model = family_model(family)
    graphdef, state = nnx.split(model)
    state = nnx.to_pure_dict(state)
    run = jax.jit(decode, static_argnums=(0, 2))
    expected, per_layer = run(graphdef, state, False), run(graphdef, state, True)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(per_layer), strict=True):
        np.testing.assert_array_equal(a, b)
    # The outputs do depend on every layer's weights: a changed last layer changes them.
    pure = jax.tree.map(lambda x: x, state)
    kernel = pure["layers"]["self_attn"]["o_proj"]["kernel"]
    pure["layers"]["self_attn"]["o_proj"]["kernel"] = kernel.at[-1].multiply(2.0)
    changed = run(graphdef, pure, True)
    assert not np.array_equal(changed[0][-1], per_layer[0][-1])


@pytest.mark.parametrize("family", ["gemma2", "qwen3_moe"])
def test_an_unrolled_scan_computes_what_one_layer_a_step_computes(family):
    """`scan_unroll=3`: the three layers as one step of the scan's loop, in the stacked layout
    and in the decoding one, give what a loop of one layer a step gives, on the same weights:
    compared in float64, where only the order of sums could differ."""
    with jax.enable_x64(True):
        f64 = dict(dtype="float64", param_dtype="float64")
        graphdef, state = nnx.split(family_model(family, **f64))
        unrolled, _ = nnx.split(family_model(family, **f64, scan_unroll=3))
        state = nnx.to_pure_dict(state)
        run = jax.jit(decode, static_argnums=(0, 2))
        expected = run(graphdef, state, False)
        for per_layer in (False, True):
            traced = functools.partial(decode, unrolled, per_layer=per_layer)
            program = str(jax.make_jaxpr(traced)(state))
            assert "unroll=3" in program and "unroll=1" not in program
            got = run(unrolled, state, per_layer)
            for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got), strict=True):
                assert a.dtype == b.dtype
                np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)


def test_each_stacked_dense_kernel_is_held_per_layer_and_the_rest_stays_stacked():
    model = family_model("qwen3_moe")
    graphdef, state = nnx.split(model)
    decoding = nnx.merge(graphdef, model.decoding_layout(nnx.to_pure_dict(state)))
    kernels = decoding.layers.self_attn.q_proj.kernel.get_value()
    assert isinstance(kernels, PerLayer) and len(kernels.arrays) == 3
    np.testing.assert_array_equal(kernels.arrays[2], model.layers.self_attn.q_proj.kernel[2])
    assert isinstance(decoding.layers.mlp.gate.kernel.get_value(), PerLayer)  # the router
    experts = decoding.layers.mlp.experts["up_proj"].kernel[...]  # not a Dense: copied
    assert isinstance(experts, jax.Array) and experts.shape[0] == 3
    assert isinstance(decoding.layers.input_layernorm.scale[...], jax.Array)
    assert isinstance(model.layers.self_attn.q_proj.kernel[...], jax.Array)  # left as it was
    weight = kernels.at(jnp.int32(1)).astype(jnp.float64)
    assert isinstance(weight, LayerWeight) and weight[...] is weight
    assert weight.shape == (32, 32) and weight.dtype == jnp.float64
    with pytest.raises(TypeError, match="read whole"):
        weight[0]


def test_unstacked_layers_and_adapted_products_are_left_as_they_are():
    model = family_model("llama", scan_layers=False)
    params = nnx.to_pure_dict(nnx.state(model))
    assert model.decoding_layout(params) is params
    stacked = family_model("llama")
    params = nnx.to_pure_dict(nnx.state(stacked))
    with plain_products():  # how `peft.lora` traces: adapted weights keep their own products
        assert stacked.decoding_layout(params) is params


def test_a_decode_step_copies_no_layer_weight_out_of_its_stack():
    """The stacked `[L, H, F]` kernels reach the products whole: no `dynamic-slice` of one
    in the optimized program, where the scan over the stacks has one per kernel."""
    model = family_model("llama")
    graphdef, state = nnx.split(model)
    cache = model.init_cache(2, 9)

    def step(state, cache, per_layer):
        model = nnx.merge(graphdef, state)
        if per_layer:
            model = nnx.merge(graphdef, model.decoding_layout(nnx.to_pure_dict(state)))
        return model.extend(jnp.array([[1], [2]]), None, cache)

    def sliced_kernels(per_layer):
        step_fn = jax.jit(step, static_argnums=2)
        text = step_fn.lower(state, cache, per_layer).compile().as_text()
        # A layer's slice of a q/k/v/o, gate/up or down kernel: [1, in, out].
        kernel = r"f32\[1,(?:32,32|32,16|32,64|64,32)\]\{[0-9,]*\} dynamic-slice\("
        return re.findall(kernel, text)

    assert sliced_kernels(False)  # the check sees the copies where they are
    assert sliced_kernels(True) == []
