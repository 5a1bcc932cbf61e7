"""LoRA and quantised bases on mixture-of-experts weights: the grouped-product rules."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests._helpers import assert_close, raises_naming
from tunelib import peft
from tunelib.models import PROJECTION_KERNELS, Decoder, DecoderConfig

CONFIG = dict(
    vocab_size=40,
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    head_dim=16,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    initializer_range=0.3,
)
RULES = [
    peft.LoraRule(pattern=PROJECTION_KERNELS, rank=4, alpha=8.0),
    peft.LoraRule(pattern=r"layers/(\d+/)?mlp/gate/kernel", rank=2, alpha=4.0),  # routers
]
TOKENS = np.random.default_rng(0).integers(0, 40, size=(2, 7))


# Gemma 4's experts: one fused `gate_up_proj` `[E, H, 2F]` per layer, beside a dense MLP,
# with its own router (`router/proj`); the full layer wider than the sliding one.
GEMMA4 = dict(
    CONFIG,
    num_attention_heads=2,
    head_dim=8,
    global_head_dim=16,
    layer_types=("sliding_attention", "full_attention"),
    sliding_window=3,
    use_qk_norm=True,
    value_norm=True,
    sandwich_norms=True,
    layer_scalars=True,
    norm_topk_prob=True,
    parallel_moe=True,
    hidden_size_per_layer_input=4,
    hidden_act="gelu_pytorch_tanh",
)
# gpt-oss's experts: one interleaved `gate_up_proj` `[E, H, 2F]` with biases in the MLP,
# a biased router (`mlp/router`), attention sinks (1-D: no low-rank form, never adapted).
GPT_OSS = dict(
    CONFIG,
    layer_types=("sliding_attention", "full_attention"),
    sliding_window=3,
    attention_bias=True,
    o_proj_bias=True,
    attention_sinks=True,
    norm_topk_prob=True,
    biased_experts=True,
    swiglu_alpha=1.702,
    swiglu_limit=7.0,
)
GPT_OSS_RULES = [
    peft.LoraRule(pattern=PROJECTION_KERNELS, rank=4, alpha=8.0),
    peft.LoraRule(pattern=r"layers/\d+/mlp/router/kernel", rank=2, alpha=4.0),
]
GEMMA4_RULES = [
    peft.LoraRule(pattern=PROJECTION_KERNELS, rank=4, alpha=8.0),
    peft.LoraRule(pattern=r"layers/\d+/router/proj/kernel", rank=2, alpha=4.0),
]


def model_and_adapters(scan_layers: bool, fields=CONFIG, rules=RULES):
    config = DecoderConfig(**fields, scan_layers=scan_layers)
    graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
    adapters = peft.init_lora(params, rules, key=jax.random.key(1))
    # Nonzero B everywhere, so the low-rank path counts in every product.
    adapters = jax.tree.map(
        lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape), adapters
    )
    return graphdef, params, adapters


def forward(graphdef):
    def run(params, tokens):
        model = nnx.merge(graphdef, params)
        return model.unembed(model(tokens))

    return run


@pytest.mark.parametrize("model", ["scanned", "unscanned", "gemma4", "gpt_oss"])
def test_adapted_experts_equal_the_merged_weights_in_values_and_gradients(model):
    """x W + s (x A) B through the grouped-product rules is the same function as x (W + s A B):
    compared in float64, where the two orders of computation agree to rounding (about 1e-15).
    In float32 they are each about 1e-4 from the float64 gradients, in different places, and
    by how much depends on the CPU's vector width, so no fixed float32 tolerance holds."""
    fields = {"gemma4": GEMMA4, "gpt_oss": GPT_OSS}.get(model, CONFIG)
    fields = dict(fields, dtype="float64", param_dtype="float64")
    with jax.enable_x64(True):
        if model == "gpt_oss":
            graphdef, params, adapters = model_and_adapters(False, fields, GPT_OSS_RULES)
            layer = adapters["layers"][1]
            assert layer["mlp"]["experts"]["gate_up_proj"]["kernel"].b.shape == (4, 4, 128)
            assert layer["mlp"]["experts"]["down_proj"]["kernel"].a.shape == (4, 64, 4)
            assert layer["mlp"]["router"]["kernel"].b.shape == (2, 4)
            # Sinks, biases and norms are not matrices: no adapter (they stay frozen).
            is_adapter = lambda x: isinstance(x, peft.LoraAdapter)  # noqa: E731
            leaves = jax.tree_util.tree_leaves_with_path(adapters, is_leaf=is_adapter)
            adapted = {jax.tree_util.keystr(p) for p, x in leaves if is_adapter(x)}
            assert len(adapted) == 2 * 7  # q, k, v, o, router, gate_up, down per layer
            assert not [p for p in adapted if "sinks" in p or "bias" in p], adapted
        elif model == "gemma4":
            graphdef, params, adapters = model_and_adapters(False, fields, GEMMA4_RULES)
            layer = adapters["layers"][1]
            assert layer["experts"]["gate_up_proj"]["kernel"].a.shape == (4, 32, 4)
            assert layer["experts"]["gate_up_proj"]["kernel"].b.shape == (4, 4, 128)
            assert layer["router"]["proj"]["kernel"].b.shape == (2, 4)
            assert layer["self_attn"]["q_proj"]["kernel"].b.shape == (4, 32)  # 2 heads of 16
        else:
            graphdef, params, adapters = model_and_adapters(model == "scanned", fields)
            kernel = adapters["layers"]
            kernel = kernel["mlp"] if model == "scanned" else kernel[0]["mlp"]
            lead = (2,) if model == "scanned" else ()
            assert kernel["experts"]["gate_proj"]["kernel"].a.shape == (*lead, 4, 32, 4)
            assert kernel["gate"]["kernel"].b.shape == (*lead, 2, 4)
        assert all(x.dtype == jnp.float64 for x in jax.tree.leaves((params, adapters)))
        run = forward(graphdef)
        ct = np.random.default_rng(3).normal(size=(2, 7, 40))

        def adapted(adapters):
            return jnp.sum(peft.lora(run)(peft.apply_lora(params, adapters), TOKENS) * ct)

        def merged(adapters):
            return jnp.sum(run(peft.merge_lora(params, adapters), TOKENS) * ct)

        with warnings.catch_warnings():
            warnings.simplefilter("error", peft.MaterializationWarning)  # no dense W + sAB
            value, grads = jax.jit(jax.value_and_grad(adapted))(adapters)
        expected_value, expected = jax.jit(jax.value_and_grad(merged))(adapters)
    assert value.dtype == jnp.float64
    assert_close(value, expected_value, rtol=1e-10)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        got, want = np.asarray(got), np.asarray(want)
        assert got.dtype == want.dtype == np.float64
        scale = np.abs(want).max()
        assert scale > 0
        assert_close(got, want, rtol=1e-9, atol=1e-11 * scale)


@pytest.mark.parametrize(("fmt", "family"), [("nf4", "gpt_oss"), ("int8", "qwen3_moe")])
def test_quantised_experts_equal_their_dequantised_base(fmt, family):
    """NF4 on gpt-oss's biased experts (`gate_up_proj`, `down_proj`), int8 on Qwen3-MoE's, under
    LoRA: the same values and gradients as their dequantised weights."""
    if family == "gpt_oss":
        graphdef, params, adapters = model_and_adapters(False, GPT_OSS, GPT_OSS_RULES)
    else:
        graphdef, params, adapters = model_and_adapters(False)
    expert_kernels = r"layers/\d+/mlp/experts/.*_proj/kernel"
    base = peft.quantize_params(params, [expert_kernels], format=fmt)
    kernel = base["layers"][0]["mlp"]["experts"]["down_proj"]["kernel"]
    assert type(kernel).__name__ == {"nf4": "NF4Tensor", "int8": "Int8Tensor"}[fmt]
    assert kernel.shape == (4, 64, 32)
    run = forward(graphdef)
    dense = peft.dequantize_params(base)

    def loss(adapters, params, wrap):
        return jnp.sum(wrap(run)(peft.apply_lora(params, adapters), TOKENS) ** 2)

    got, grads = jax.jit(jax.value_and_grad(lambda a: loss(a, base, peft.lora)))(adapters)
    want, expected = jax.jit(jax.value_and_grad(lambda a: loss(a, dense, peft.lora)))(adapters)
    assert_close(got, want, rtol=1e-5)
    for g, e in zip(jax.tree.leaves(grads), jax.tree.leaves(expected), strict=True):
        assert_close(g, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scan_layers", [False, True])
def test_expert_adapters_round_trip_through_the_peft_format(tmp_path, scan_layers):
    from safetensors.numpy import load_file

    _, params, adapters = model_and_adapters(scan_layers)
    peft.export_peft(tmp_path / "peft", adapters, params)
    names = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    prefix = "base_model.model.model.layers.1.mlp"
    assert names[f"{prefix}.experts.3.down_proj.lora_A.weight"].shape == (4, 64)
    assert names[f"{prefix}.gate.lora_B.weight"].shape == (4, 2)
    back = peft.import_peft(tmp_path / "peft", params)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(adapters), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("family", ["gemma4", "gpt_oss"])
def test_fused_experts_are_not_exported_to_peft(tmp_path, family):
    """PEFT adapts Gemma 4's and gpt-oss's fused experts as parameters, a layout not
    written: a clear error naming the weight, and nothing on disk. Without adapters on the
    experts, the rest exports and imports back."""
    fields, rules, experts = {
        "gemma4": (GEMMA4, GEMMA4_RULES, "layers/0/experts/"),
        "gpt_oss": (GPT_OSS, GPT_OSS_RULES, "layers/0/mlp/experts/down_proj"),
    }[family]
    _, params, adapters = model_and_adapters(False, fields, rules)
    with raises_naming(experts, "merge_lora"):
        peft.export_peft(tmp_path / "adapters", adapters, params)
    assert not (tmp_path / "adapters").exists()
    if family == "gpt_oss":
        attention = [peft.LoraRule(pattern=r"layers/\d+/self_attn/.*_proj/kernel", rank=4)]
        adapters = peft.init_lora(params, attention, key=jax.random.key(1))
        peft.export_peft(tmp_path / "attention", adapters, params)
        back = peft.import_peft(tmp_path / "attention", params)
        for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(adapters), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
