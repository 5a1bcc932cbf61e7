"""Qwen3.5 text: its config fields read or refused, the gated delta rule (chunked against
recurrent against a float64 NumPy reference of the recurrence), the short convolution and
the gated norm, decoding with the cache's states, and parity with transformers'
`Qwen3_5ForCausalLM` (padded logits, 20 greedy tokens from the sampler equal to `generate`,
our save reloaded)."""

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests._helpers import assert_traced_once, raises_naming
from tests._hf import (
    assert_reloads_equal,
    hf_greedy,
    hf_logits,
    hf_modules,
    model_class,
    undocumented_config_fields,
    write_tiny_checkpoint,
)
from tests.models.test_moe import expert_parallel_equals_one_device
from tunelib import peft
from tunelib.formats import config_from_hf, config_to_hf, load_hf_checkpoint, save_hf_checkpoint
from tunelib.models import (
    PROJECTION_KERNELS,
    Decoder,
    DecoderConfig,
    causal_conv1d,
    chunked_gated_delta_rule,
    gated_rms_norm,
    recurrent_gated_delta_rule,
    unit_lower_inverse,
)
from tunelib.rollout import SamplingConfig, sample

DOCS = Path(__file__).parents[2] / "docs" / "models.md"
# A tiny Qwen3.5: Gated DeltaNet layers around a gated full-attention one.
CONFIG = dict(
    vocab_size=40,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    layer_types=("linear_attention", "full_attention", "linear_attention"),
    partial_rotary_factor=0.25,
    attention_output_gate=True,
    use_qk_norm=True,
    norm_offset=True,
    linear_conv_kernel_dim=3,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)
HF_BASE = {
    "model_type": "qwen3_5_text",
    "vocab_size": 40,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


@pytest.mark.parametrize("config_class", ["Qwen3_5TextConfig", "Qwen3_5MoeTextConfig"])
def test_every_qwen3_5_config_field_is_documented(config_class):
    """docs/models.md's Qwen3.5 tables name each field of `Qwen3_5TextConfig` and
    `Qwen3_5MoeTextConfig` (and the `full_attention_interval` their constructors pop) with
    what the decoder does with it, so a field transformers adds fails here until it is read
    or refused."""
    popped = ("full_attention_interval",)
    missing = undocumented_config_fields(config_class, DOCS, "Qwen3.5", popped)
    assert not missing, missing


def test_defaults_and_the_round_trip():
    """transformers' defaults: three linear layers then a full one, a quarter of each head
    rotated; the multimodal RoPE's sections are read as plain RoPE."""
    rope = {"rope_type": "default", "rope_theta": 1e7, "mrope_section": [2, 1, 1],
            "mrope_interleaved": True}  # fmt: skip
    config = config_from_hf({**HF_BASE, "rope_parameters": rope})
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention",)
    assert config.linear_layers == (True, True, True, False)
    assert config.partial_rotary_factor == 0.25 and config.rotary_dim == 4
    assert config.rope_theta == 1e7 and config.rope_scaling is None
    assert config.use_qk_norm and config.norm_offset and config.attention_output_gate
    assert (config.linear_num_key_heads, config.linear_num_value_heads) == (16, 32)
    assert config_from_hf({**HF_BASE, "full_attention_interval": 2}).linear_layers == (
        True, False, True, False
    )  # fmt: skip
    ours = DecoderConfig(**CONFIG)
    written = json.loads(json.dumps(config_to_hf(ours, model_type="qwen3_5_text")))
    assert written["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert config_from_hf(written) == ours
    with raises_naming("qwen3", "linear_attention"):
        config_to_hf(dataclasses.replace(ours, attention_output_gate=False), model_type="qwen3")
    with raises_naming("qwen3_5_text", "attention_output_gate"):
        config_to_hf(dataclasses.replace(ours, attention_output_gate=False),
                     model_type="qwen3_5_text")  # fmt: skip


def test_moe_defaults_and_the_round_trip():
    """Qwen3.5-MoE: every layer a mixture of experts (renormalised top k) with a shared
    expert; `intermediate_size`, which transformers does not read, is the experts' width."""
    hf = {k: x for k, x in HF_BASE.items() if k != "intermediate_size"}
    config = config_from_hf({**hf, "model_type": "qwen3_5_moe_text"})
    assert config.moe_layers == (True,) * 4 and config.norm_topk_prob
    assert (config.num_experts, config.num_experts_per_tok) == (256, 8)
    assert config.moe_intermediate_size == config.intermediate_size == 512
    assert config.shared_expert_intermediate_size == 512
    ours = DecoderConfig(**{**CONFIG, "intermediate_size": 16}, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                         shared_expert_intermediate_size=24)  # fmt: skip
    written = json.loads(json.dumps(config_to_hf(ours, model_type="qwen3_5_moe_text")))
    assert "intermediate_size" not in written and written["num_experts"] == 4
    assert config_from_hf(written) == ours
    with raises_naming("qwen3_5_text", "num_experts"):
        config_to_hf(ours, model_type="qwen3_5_text")
    with raises_naming("qwen3_5_moe_text", "norm_topk_prob"):
        config_to_hf(dataclasses.replace(ours, norm_topk_prob=False),
                     model_type="qwen3_5_moe_text")  # fmt: skip
    with raises_naming("shared_expert_intermediate_size"):
        DecoderConfig(**CONFIG, shared_expert_intermediate_size=8)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("layer_types", ["linear_attention", "sliding_attention"] * 2, "layer_types"),
        ("full_attention_interval", 0, "full_attention_interval"),
        ("attention_dropout", 0.1, "attention_dropout"),
        ("hidden_act", "gelu", "hidden_act"),
        ("rope_parameters", {"rope_type": "longrope", "factor": 2.0}, "longrope"),
        ("rope_parameters", {"rope_type": "default", "partial_rotary_factor": 1.5},
         "partial_rotary_factor"),
        ("linear_num_value_heads", 3, "linear_num_value_heads"),
        ("quantization_config", {"quant_method": "fp8"}, "quantization_config"),
        ("attention_bias", "yes", "attention_bias"),
    ],
)  # fmt: skip
def test_unsupported_qwen3_5_fields_are_named(field, value, named):
    with raises_naming(named):
        config_from_hf({**HF_BASE, field: value})


def test_config_errors_name_the_field():
    with raises_naming("layer_types"):
        DecoderConfig(**{**CONFIG, "layer_types": ("mamba",) * 3})
    with raises_naming("linear_num_value_heads"):
        DecoderConfig(**{**CONFIG, "linear_num_value_heads": 5})
    with raises_naming("partial_rotary_factor"):
        DecoderConfig(**{**CONFIG, "partial_rotary_factor": 0.05})
    with raises_naming("scan_layers"):
        DecoderConfig(**CONFIG, scan_layers=True)
    model = nnx.eval_shape(lambda: Decoder(DecoderConfig(**CONFIG), rngs=nnx.Rngs(0)))
    with raises_naming("segment_ids", "linear_attention"):
        model(jnp.ones((1, 4), jnp.int32), segment_ids=jnp.ones((1, 4), jnp.int32))


# ----------------------------------------------------------------------- the gated delta rule


def reference_delta_rule(q, k, v, g, beta, state):
    """Yang et al. (2024), eq. 10, one token at a time in float64, with $S$ `[Dv, Dk]`:
    $S_t = \\alpha_t S_{t-1}(I - \\beta_t k_t k_t^\\top) + \\beta_t v_t k_t^\\top$,
    $o_t = S_t q_t$, $\\alpha_t = e^{g_t}$. `state` is given `[B, H, Dk, Dv]` (transposed)."""
    q, k, v, g, beta, state = (np.asarray(x, np.float64) for x in (q, k, v, g, beta, state))
    b, t, h, dk = q.shape
    out = np.zeros((*v.shape[:3], v.shape[-1]))
    final = np.zeros_like(state)
    for row in range(b):
        for head in range(h):
            s = state[row, head].T
            for i in range(t):
                kt, vt = k[row, i, head], v[row, i, head]
                a, bt = np.exp(g[row, i, head]), beta[row, i, head]
                s = a * s @ (np.eye(dk) - bt * np.outer(kt, kt)) + bt * np.outer(vt, kt)
                out[row, i, head] = s @ q[row, i, head]
            final[row, head] = s.T
    return out, final


def delta_inputs(seed, b=2, t=11, h=3, dk=4, dv=5):
    keys = jax.random.split(jax.random.key(seed), 6)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
    q = unit(jax.random.normal(keys[0], (b, t, h, dk))) * dk**-0.5
    k = unit(jax.random.normal(keys[1], (b, t, h, dk)))
    v = jax.random.normal(keys[2], (b, t, h, dv))
    g = -jax.random.uniform(keys[3], (b, t, h), maxval=1.5)
    beta = jax.random.uniform(keys[4], (b, t, h))
    state = jax.random.normal(keys[5], (b, h, dk, dv))
    return q, k, v, g, beta, state


def test_recurrent_and_chunked_equal_the_float64_reference():
    """Outputs and final state, from a given state, for chunks that leave a partial one and
    for one chunk over the whole sequence."""
    inputs = delta_inputs(0)
    expected_out, expected_state = reference_delta_rule(*inputs)
    step = jax.jit(recurrent_gated_delta_rule)
    forms = {"recurrent": step(*inputs)}
    for size in (4, 16):
        fn = jax.jit(lambda *x, size=size: chunked_gated_delta_rule(*x, chunk_size=size))
        forms[f"chunks of {size}"] = fn(*inputs)
    for name, (out, state) in forms.items():
        np.testing.assert_allclose(out, expected_out, atol=2e-5, err_msg=name)
        np.testing.assert_allclose(state, expected_state, atol=2e-5, err_msg=name)
    assert np.abs(expected_out).max() > 0.5


def test_chunked_equals_recurrent_in_float64_and_decodes_on():
    """In float64 the two forms agree to 1e-12; a prefill by chunks then tokens one at a time
    from its state equals one pass over the whole sequence."""
    with jax.enable_x64(True):
        q, k, v, g, beta, state = (x.astype(jnp.float64) for x in delta_inputs(1, t=9))
        step = jax.jit(recurrent_gated_delta_rule)
        whole, final = step(q, k, v, g, beta, state)
        chunked_fn = jax.jit(chunked_gated_delta_rule, static_argnames="chunk_size")
        chunked, chunked_final = chunked_fn(q, k, v, g, beta, state, chunk_size=3)
        np.testing.assert_allclose(chunked, whole, atol=1e-12)
        np.testing.assert_allclose(chunked_final, final, atol=1e-12)
        prefix = [x[:, :5] for x in (q, k, v, g, beta)]
        rest = [x[:, 5:] for x in (q, k, v, g, beta)]
        first, s = chunked_fn(*prefix, state, chunk_size=2)
        tail = []
        for i in range(4):  # one compiled step
            out, s = step(*(x[:, i : i + 1] for x in rest), s)
            tail.append(out)
        np.testing.assert_allclose(jnp.concatenate([first, *tail], 1), whole, atol=1e-12)
        np.testing.assert_allclose(s, final, atol=1e-12)


def test_chunked_gradients_equal_the_recurrent_ones_in_float64():
    """Training differentiates the chunked form (through its triangular inverse): its
    gradients with respect to every input, the initial state included, equal the
    recurrence's."""
    with jax.enable_x64(True):
        inputs = tuple(x.astype(jnp.float64) for x in delta_inputs(3, t=7))
        weights = jax.random.normal(jax.random.key(4), (2, 7, 3, 5), jnp.float64)

        def loss(form, *inputs):
            out, state = form(*inputs)
            return jnp.sum(out * weights) + jnp.sum(state**2)

        def chunked(*x):
            return chunked_gated_delta_rule(*x, chunk_size=3)

        argnums = tuple(range(1, 7))
        expected = jax.jit(jax.grad(loss, argnums), static_argnums=0)(
            recurrent_gated_delta_rule, *inputs
        )
        got = jax.jit(jax.grad(loss, argnums), static_argnums=0)(chunked, *inputs)
        for name, a, b in zip(("q", "k", "v", "g", "beta", "state"), got, expected, strict=True):
            np.testing.assert_allclose(a, b, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("size", [1, 3, 8, 13])
def test_unit_lower_inverse_equals_numpy_in_float64(size):
    """Sizes that are and are not powers of two; what is on and above the diagonal is not
    read; a batch of matrices is inverted one by one."""
    rng = np.random.default_rng(size)
    a = rng.normal(size=(2, 3, size, size)) / 2
    unit = np.tril(a, -1) + np.eye(size)
    with jax.enable_x64(True):
        got = np.asarray(jax.jit(unit_lower_inverse)(jnp.asarray(a)))
    np.testing.assert_allclose(got, np.linalg.inv(unit), rtol=1e-12, atol=1e-12)
    assert got.dtype == np.float64


def test_the_chunked_rule_and_its_gradient_call_no_lapack():
    """jaxlib 0.10's batched LAPACK triangular solve waits on XLA's CPU thread pool from a
    thread of that pool: two of them at once hung a GRPO step on a 2-core machine. The rule,
    forward and backward, must lower to matrix products only."""

    def loss(*x):
        out, state = chunked_gated_delta_rule(*x, chunk_size=4)
        return jnp.sum(out) + jnp.sum(state)

    text = jax.jit(jax.value_and_grad(loss, range(6))).lower(*delta_inputs(0)).as_text()
    assert "dot_general" in text
    for name in ("lapack", "triangular_solve", "custom_call"):
        assert name not in text, name


def test_new_values_do_not_recompile():
    def chunked(*inputs):
        return chunked_gated_delta_rule(*inputs, chunk_size=4)

    for fn in (recurrent_gated_delta_rule, chunked):
        assert_traced_once(fn, [(delta_inputs(seed), {}) for seed in (0, 5)])


def test_delta_rule_shapes_are_checked():
    q, k, v, g, beta, state = delta_inputs(2)
    with raises_naming("beta"):
        chunked_gated_delta_rule(q, k, v, g, beta[:, :-1])
    with raises_naming("state"):
        recurrent_gated_delta_rule(q, k, v, g, beta, state[..., :-1])
    with raises_naming("chunk_size"):
        chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=0)


def test_causal_conv1d_and_its_state():
    """Equals PyTorch's depthwise `Conv1d(padding=K-1)` cut to T; a split sequence continues
    from the state."""
    torch, _ = hf_modules()
    x = np.random.default_rng(0).normal(size=(2, 7, 5)).astype(np.float32)
    weight = np.random.default_rng(1).normal(size=(5, 3)).astype(np.float32)
    expected = (
        torch.nn.functional.conv1d(
            torch.tensor(x).transpose(1, 2), torch.tensor(weight)[:, None], padding=2, groups=5
        )[:, :, :7]
        .transpose(1, 2)
        .numpy()
    )
    y, state = causal_conv1d(x, weight)
    np.testing.assert_allclose(y, expected, atol=1e-6)
    first, s = causal_conv1d(x[:, :4], weight)
    second, s = causal_conv1d(x[:, 4:], weight, s)
    np.testing.assert_allclose(np.concatenate([first, second], 1), y, atol=1e-6)
    np.testing.assert_array_equal(s, state)


def test_gated_rms_norm_formula():
    x = np.random.default_rng(0).normal(size=(3, 6))
    gate = np.random.default_rng(1).normal(size=(3, 6))
    scale = np.random.default_rng(2).normal(size=6)
    normed = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + 1e-6)
    expected = scale * normed * gate / (1 + np.exp(-gate))
    got = gated_rms_norm(x.astype(np.float32), gate.astype(np.float32), scale.astype(np.float32))
    np.testing.assert_allclose(got, expected, atol=1e-5)


# --------------------------------------------------------------------------- with transformers

# Three rows of 12: left-padded by 3, right-padded by 2, unpadded; ids at padding are junk.
TOKENS = np.random.default_rng(0).integers(4, 300, size=(3, 12))
WHERE = np.ones(TOKENS.shape, bool)
WHERE[0, :3] = False
WHERE[1, -2:] = False


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny `Qwen3_5ForCausalLM` written by transformers, its padded-batch logits, and the
    checkpoint loaded with chunks of 4 tokens (several per row) in the chunked form."""
    directory = tmp_path_factory.mktemp("qwen3_5") / "hf"
    write_tiny_checkpoint(directory, "qwen3_5_text", tokenizer=False)
    reference = model_class("qwen3_5_text").from_pretrained(directory).eval()
    loaded = load_hf_checkpoint(directory)
    config = dataclasses.replace(loaded.config, linear_chunk_size=4)
    graphdef = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))[0]
    loaded = loaded._replace(graphdef=graphdef, config=config)
    return loaded, reference, hf_logits(reference, TOKENS, WHERE)


def test_matches_transformers_and_transformers_reloads_our_save(tmp_path, checkpoint):
    """Padded-batch logits within 1e-4, left padding invisible, and our save loads in
    transformers with equal weights and logits."""
    loaded, reference, expected = checkpoint
    assert loaded.config.linear_layers == (True, False, True)

    @jax.jit
    def logits(params, tokens, where):
        model = nnx.merge(loaded.graphdef, params)
        return model.unembed(model(tokens, where=where))

    ours = np.asarray(logits(loaded.params, TOKENS, WHERE))
    error = np.abs(ours - expected)[WHERE].max()
    assert error < 1e-4, error
    # The left-padded row's real tokens get the logits of the same tokens unpadded.
    alone = logits(loaded.params, TOKENS[:1, 3:], WHERE[:1, 3:])
    np.testing.assert_allclose(ours[0, 3:], alone[0], atol=2e-5)
    assert np.abs(expected[WHERE]).max() > 1.0  # logits far from uniform: the test has teeth

    ours = save_hf_checkpoint(tmp_path / "ours", loaded.graphdef, loaded.params,
                              hf_config=loaded.hf_config)  # fmt: skip
    assert_reloads_equal("qwen3_5_text", ours, reference, TOKENS, WHERE)


def test_decoding_equals_the_forward_and_generate(checkpoint):
    """A prefill of 7 columns (two chunks) then 5 single tokens through the cache (the
    DeltaNet layers' convolution and recurrent states, the attention layer's keys and values)
    gives the hidden states of one forward pass; 20 greedy tokens from the sampler after left-padded
    prompts equal `generate`'s."""
    loaded, reference, _ = checkpoint
    model = nnx.merge(loaded.graphdef, loaded.params)
    rows, where = TOKENS[[0, 2]], WHERE[[0, 2]]

    @nnx.jit
    def decoded_and_forward(model, rows, where):
        cache = model.init_cache(2, 16)
        assert cache.conv.shape == (2, 2, 2, 2 * 16 + 64)  # [L_n, B, K_c - 1, C]
        assert cache.recurrent.shape == (2, 2, 4, 8, 16)  # [L_n, B, h_v, d_k, d_v]
        assert [k.shape for k in cache.keys] == [(1, 2, 2, 16, 16)]  # the attention layer
        prefill, cache = model.extend(rows[:, :7], where[:, :7], cache)

        def step(cache, column):
            hidden, cache = model.extend(column[0][:, None], column[1][:, None], cache)
            return cache, hidden[:, 0]

        _, steps = jax.lax.scan(step, cache, (rows[:, 7:].T, where[:, 7:].T))
        decoded = jnp.concatenate([prefill, jnp.swapaxes(steps, 0, 1)], axis=1)
        return decoded, model(rows, where=where)

    decoded, full = decoded_and_forward(model, rows, where)
    np.testing.assert_allclose(np.asarray(decoded)[where], np.asarray(full)[where], atol=5e-5)

    generated = hf_greedy(reference, rows, where, 20)
    rollout = sample(loaded.graphdef, loaded.params, rows, where, jax.random.key(0),
                     SamplingConfig(max_new_tokens=20, temperature=0.0))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(rollout.tokens), generated)


def test_moe_matches_transformers_and_transformers_reloads_our_save(tmp_path):
    """Qwen3.5-MoE (a DeltaNet and a full layer, each with four experts, top 2, and a gated
    shared expert): padded-batch logits within 1e-4, 20 greedy tokens from the sampler equal
    `generate`'s, and our save loads in transformers with equal weights and logits."""
    directory = write_tiny_checkpoint(tmp_path / "hf", "qwen3_5_moe_text", tokenizer=False)
    reference = model_class("qwen3_5_moe_text").from_pretrained(directory).eval()
    expected = hf_logits(reference, TOKENS, WHERE)
    loaded = load_hf_checkpoint(directory)
    assert loaded.config.moe_layers == (True, True)
    assert loaded.config.shared_expert_intermediate_size == 24
    model = nnx.merge(loaded.graphdef, loaded.params)
    logits = np.asarray(nnx.jit(lambda m: m.unembed(m(TOKENS, where=WHERE)))(model))
    error = np.abs(logits - expected)[WHERE].max()
    assert error < 1e-4, error
    assert np.abs(expected[WHERE]).max() > 1.0
    rows, where = TOKENS[[0, 2]], WHERE[[0, 2]]
    generated = hf_greedy(reference, rows, where, 20)
    rollout = sample(loaded.graphdef, loaded.params, rows, where, jax.random.key(0),
                     SamplingConfig(max_new_tokens=20, temperature=0.0))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(rollout.tokens), generated)
    ours = save_hf_checkpoint(tmp_path / "ours", loaded.graphdef, loaded.params,
                              hf_config=loaded.hf_config)  # fmt: skip
    assert_reloads_equal("qwen3_5_moe_text", ours, reference, TOKENS, WHERE)


def test_moe_expert_parallel_sharding_equals_one_device():
    """8 devices: a Qwen3.5-MoE DeltaNet layer's experts over "expert" (4), widths and heads
    (the DeltaNet projections' included) over "model" (2), in float64 as the other families'
    tests; every weight gets a gradient."""
    with jax.enable_x64(True):
        fields = dict(CONFIG, num_hidden_layers=1, layer_types=("linear_attention",),
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                      norm_topk_prob=True, shared_expert_intermediate_size=24)  # fmt: skip
        config = DecoderConfig(**fields, dtype="float64", param_dtype="float64")
        graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
        grads = expert_parallel_equals_one_device(
            graphdef, params, np.asarray(TOKENS[:, :8] % 40),
            lambda s: s["layers"][0]["mlp"]["experts"]["gate_proj"]["kernel"],
            rtol=1e-10, atol=1e-12,
        )  # fmt: skip
    for path, grad in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads)):
        assert np.asarray(grad).any(), jax.tree_util.keystr(path)


def test_lora_adapts_the_delta_net_projections():
    """`PROJECTION_KERNELS` selects the Gated DeltaNet's five projections beside the
    attention's and the MLP's (not its convolution, decays or norms), and the adapted forward
    pass equals the merged weights'."""
    model = Decoder(DecoderConfig(**CONFIG, linear_chunk_size=4), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    params = nnx.to_pure_dict(state)
    adapters = peft.init_lora(params, [peft.LoraRule(pattern=PROJECTION_KERNELS, rank=2)],
                              key=jax.random.key(0))  # fmt: skip
    adapted = set(adapters["layers"][0]["linear_attn"])
    assert adapted == {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"}
    assert set(adapters["layers"][1]["self_attn"]) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(lambda x: jnp.asarray(0.3 * rng.standard_normal(x.shape)), adapters)
    tokens = jnp.asarray(TOKENS % 40)

    @jax.jit
    def both(params, adapters):
        def forward(graphdef, params):
            model = nnx.merge(graphdef, params)
            return model.unembed(model(tokens, where=WHERE))

        lora = peft.lora(forward)(graphdef, peft.apply_lora(params, adapters))
        return lora, forward(graphdef, peft.merge_lora(params, adapters))

    # Adapters of size 0.3 move the logits far more than this (so do the merged weights'),
    # so an adapted pass that ignored them would fail here.
    lora, merged = both(params, adapters)
    np.testing.assert_allclose(lora, merged, atol=1e-4)
