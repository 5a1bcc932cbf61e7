"""DeepSeek-V3: its config fields read or refused, group-limited sigmoid routing against
transformers' router, the balancing bias update against a float64 reference, the
compressed (absorbed) KV cache against the uncached forward, LoRA targets and expert
parallelism. Logits, greedy tokens from the
sampler and saving are in `test_hf_checkpoint.test_matches_transformers[deepseek_v3]`."""

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests._helpers import assert_traced_once, raises_naming
from tests._hf import hf_modules, undocumented_config_fields
from tests.models.test_kv_cache import TOKENS, WHERE
from tests.models.test_moe import expert_parallel_equals_one_device
from tunelib.formats import config_from_hf, config_to_hf
from tunelib.models import (
    PROJECTION_KERNELS,
    Decoder,
    DecoderConfig,
    expert_bias_update,
    route_grouped,
)

DOCS = Path(__file__).parents[2] / "docs" / "models.md"
# A tiny DeepSeek-V3: a dense layer, then two of 8 experts in 4 groups (2 kept), top 2, one
# shared expert; latent attention with a compressed query and interleaved YaRN RoPE.
CONFIG = dict(
    vocab_size=40,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    head_dim=8,
    kv_lora_rank=16,
    q_lora_rank=12,
    qk_nope_head_dim=8,
    v_head_dim=12,
    rope_interleave=True,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 4.0,
        "beta_fast": 8.0,
        "beta_slow": 1.0,
        "original_max_position_embeddings": 8,
        "truncate": False,
        "attention_factor": 1.0,
        "mscale_all_dim": 1.0,
    },
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    mlp_only_layers=(0,),
    norm_topk_prob=True,
    n_shared_experts=1,
    scoring_func="sigmoid",
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    initializer_range=0.2,
)
HF_BASE = {
    "model_type": "deepseek_v3",
    "vocab_size": 40,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
}


def test_every_deepseek_config_field_is_documented():
    """docs/models.md's DeepSeek-V3 table names each field with what the decoder does with
    it, so a field transformers adds fails here until it is read or refused."""
    assert not undocumented_config_fields("DeepseekV3Config", DOCS, "DeepSeek-V3")


def test_defaults_and_the_round_trip():
    """A config.json with transformers' defaults: 3 dense layers first, 256 experts in 8
    groups (4 kept), top 8, one shared expert, latent ranks 512 (keys, values) and 1536
    (queries); our config written and read back is itself."""
    config = config_from_hf(HF_BASE)
    assert config.mlp_only_layers == (0, 1, 2) and config.moe_layers == (False,) * 3 + (True,)
    assert (config.num_experts, config.num_experts_per_tok, config.n_group) == (256, 8, 8)
    assert (config.topk_group, config.n_shared_experts) == (4, 1)
    assert config.routed_scaling_factor == 2.5 and config.scoring_func == "sigmoid"
    assert (config.kv_lora_rank, config.q_lora_rank, config.head_dim) == (512, 1536, 64)
    assert (config.qk_nope_head_dim, config.v_head_dim, config.rope_interleave) == (128, 128, True)
    assert config.moe_intermediate_size == 2048 and config.rope_scaling is None
    # DeepSeek's own keys for the variant transformers computes load.
    own = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}
    assert config_from_hf({**HF_BASE, **own}) == config
    ours = DecoderConfig(**CONFIG)
    written = json.loads(json.dumps(config_to_hf(ours, model_type="deepseek_v3")))
    assert written["first_k_dense_replace"] == 1 and written["qk_rope_head_dim"] == 8
    assert written["rope_parameters"]["mscale_all_dim"] == 1.0
    assert config_from_hf(written) == ours
    plain_q = DecoderConfig(**{**CONFIG, "q_lora_rank": None})
    assert config_from_hf(config_to_hf(plain_q, model_type="deepseek_v3")) == plain_q
    with raises_naming("deepseek_v3", "mlp_only_layers"):
        config_to_hf(DecoderConfig(**{**CONFIG, "mlp_only_layers": (1,)}), model_type="deepseek_v3")
    with raises_naming("qwen3_moe", "kv_lora_rank"):
        config_to_hf(ours, model_type="qwen3_moe")


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("num_key_value_heads", 2, "num_key_value_heads"),
        ("first_k_dense_replace", None, "first_k_dense_replace"),
        ("rope_interleave", "yes", "rope_interleave"),
        ("norm_topk_prob", None, "norm_topk_prob"),
        ("n_group", None, "n_group"),
        ("n_group", 3, "n_group"),
        ("topk_group", 9, "topk_group"),
        ("hidden_act", "gelu", "hidden_act"),
        ("attention_dropout", 0.1, "attention_dropout"),
        ("rope_parameters", {"rope_type": "longrope", "factor": 2.0}, "longrope"),
        ("quantization_config", {"quant_method": "fp8"}, "quantization_config"),
        ("scoring_func", "softmax", "scoring_func"),
        ("topk_method", "greedy", "topk_method"),
        ("moe_layer_freq", 2, "moe_layer_freq"),
    ],
)
def test_unsupported_deepseek_fields_are_named(field, value, named):
    with raises_naming(named):
        config_from_hf({**HF_BASE, field: value})


def test_config_errors_name_the_field():
    with raises_naming("q_lora_rank", "kv_lora_rank"):
        DecoderConfig(**{**CONFIG, "kv_lora_rank": None})
    with raises_naming("num_key_value_heads"):
        DecoderConfig(**CONFIG, num_key_value_heads=2)
    with raises_naming("sliding_window"):
        DecoderConfig(**CONFIG, sliding_window=4)
    with raises_naming("n_shared_experts", "sigmoid"):
        DecoderConfig(**{**CONFIG, "scoring_func": "softmax"})
    with raises_naming("scoring_func"):
        DecoderConfig(**{**CONFIG, "scoring_func": "sparsemax"})
    with raises_naming("num_experts_per_tok", "topk_group"):
        DecoderConfig(**{**CONFIG, "num_experts_per_tok": 5})


def test_routing_equals_transformers_router():
    """Experts chosen within the best groups on the biased scores, weights from the scores
    alone, renormalised and scaled, as transformers' `DeepseekV3TopkRouter`."""
    torch, transformers = hf_modules()
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    theirs_config = transformers.DeepseekV3Config(
        hidden_size=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    router = DeepseekV3TopkRouter(theirs_config)
    rng = np.random.default_rng(0)
    weight = rng.normal(size=(8, 16)).astype(np.float32)
    bias = (0.3 * rng.normal(size=8)).astype(np.float32)
    hidden = rng.normal(size=(64, 16)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.tensor(weight))
        router.e_score_correction_bias.copy_(torch.tensor(bias))
        logits, their_weights, their_experts = router(torch.tensor(hidden))
    weights, experts = route_grouped(
        jnp.asarray(logits.numpy()), bias, top_k=3, n_group=4, topk_group=2,
        routed_scaling_factor=2.5,
    )  # fmt: skip
    order = np.argsort(np.asarray(experts), axis=-1)
    their_order = np.argsort(their_experts.numpy(), axis=-1)
    np.testing.assert_array_equal(
        np.take_along_axis(np.asarray(experts), order, -1),
        np.take_along_axis(their_experts.numpy(), their_order, -1),
    )
    np.testing.assert_allclose(
        np.take_along_axis(np.asarray(weights), order, -1),
        np.take_along_axis(their_weights.numpy(), their_order, -1),
        rtol=1e-6,
    )
    # The bias chose experts here: without it the choice differs for some tokens.
    _, unbiased = route_grouped(logits.numpy(), np.zeros(8), top_k=3, n_group=4, topk_group=2)
    assert (np.sort(np.asarray(unbiased), -1) != np.sort(np.asarray(experts), -1)).any()
    # Replaying the chosen experts gives the same weights.
    replayed, _ = route_grouped(logits.numpy(), bias, top_k=3, n_group=4, topk_group=2,
                                routed_scaling_factor=2.5, experts=experts)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(replayed), np.asarray(weights))
    assert_traced_once(
        lambda z, b, s: route_grouped(z, b, top_k=3, n_group=4, topk_group=2,
                                      routed_scaling_factor=s),
        [((logits.numpy(), bias, jnp.float32(s)), {}) for s in (1.0, 2.5)],
    )  # fmt: skip


def _bias_update_reference(bias, load, rate):
    bias, load = np.asarray(bias, np.float64), np.asarray(load, np.float64)
    out = bias.copy()
    for index in np.ndindex(bias.shape[:-1]):
        mean = sum(load[index]) / load.shape[-1]
        for e in range(load.shape[-1]):
            gap = mean - load[index][e]
            out[index][e] += rate * (1.0 if gap > 0 else -1.0 if gap < 0 else 0.0)
    return out


def test_expert_bias_update_equals_the_paper():
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        for shape in [(8,), (3, 8)]:
            bias = rng.normal(size=shape)
            # Integer loads of 8 experts: their mean is exact, so is each comparison.
            load = rng.integers(0, 20, size=shape).astype(np.float64)
            got = expert_bias_update(bias, load, rate=0.001)
            np.testing.assert_array_equal(
                np.asarray(got), _bias_update_reference(bias, load, 0.001)
            )
    # Over the mean down, under it up, at it unchanged; balanced loads leave the bias.
    moved = expert_bias_update(jnp.ones(4), jnp.array([6.0, 2.0, 4.0, 4.0]), rate=0.5)
    np.testing.assert_array_equal(np.asarray(moved), [0.5, 1.5, 1.0, 1.0])
    same = expert_bias_update(jnp.ones(4), jnp.full(4, 3.0), rate=0.5)
    np.testing.assert_array_equal(np.asarray(same), np.ones(4))
    with raises_naming("expert_load"):
        expert_bias_update(jnp.zeros(4), jnp.zeros(5))
    assert_traced_once(
        lambda b, c, r: expert_bias_update(b, c, rate=r),
        [((jnp.zeros(4), jnp.arange(4.0), jnp.float32(r)), {}) for r in (0.1, 0.2)],
    )


def test_the_cache_holds_the_latent_and_decodes_as_the_forward():
    """The cache stores `kv_lora_rank + head_dim` numbers per token and layer (no values),
    against `N (qk_nope_head_dim + head_dim + v_head_dim)` for a plain cache; a prompt and
    then a block in the absorbed form give the uncached hidden states, padding and a stopped
    row included (one token at a time: the sampler's, in `test_hf_checkpoint`)."""
    moe = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "mlp_only_layers",
           "norm_topk_prob", "n_shared_experts", "scoring_func", "n_group", "topk_group",
           "routed_scaling_factor")  # fmt: skip
    dense = {k: x for k, x in CONFIG.items() if k not in moe}
    config = DecoderConfig(**{**dense, "num_hidden_layers": 2})
    graphdef, state = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))

    @jax.jit
    def run(state):
        model = nnx.merge(graphdef, state)
        full = model(TOKENS, where=WHERE)
        cache = model.init_cache(3, TOKENS.shape[1])
        steps = []
        for start, stop in ((0, 5), (5, 10)):  # a prompt, then a block after it
            hidden, cache = model.extend(TOKENS[:, start:stop], WHERE[:, start:stop], cache)
            steps.append(hidden)
        return full, jnp.concatenate(steps, axis=1), cache

    full, decoded, cache = run(state)
    assert [k.shape for k in cache.keys] == [(2, 3, 1, 10, 16 + 8)]
    assert [v.shape for v in cache.values] == [(2, 3, 1, 10, 0)]
    # Per token and layer, as docs/models.md reports for this model: 24 against 112.
    cached = sum(x[0, 0, :, 0].size for x in (*cache.keys, *cache.values))
    c = config
    plain = c.num_attention_heads * (c.qk_nope_head_dim + c.head_dim + c.v_head_dim)
    assert (cached, plain) == (24, 112)
    np.testing.assert_allclose(
        np.asarray(decoded)[WHERE], np.asarray(full)[WHERE], rtol=1e-5, atol=1e-5
    )


def test_lora_targets_the_latent_projections():
    """The usual LoRA targets include every MLA projection, the shared and routed experts,
    and leave out the router and the norms."""
    config = DecoderConfig(**CONFIG)
    state = nnx.state(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    paths = [
        "/".join(map(str, (k.key for k in path)))
        for path, _ in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))
    ]
    matched = {p for p in paths if re.fullmatch(PROJECTION_KERNELS, p)}
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        assert f"layers/1/self_attn/{name}/kernel" in matched, name
    assert "layers/1/mlp/shared_experts/gate_proj/kernel" in matched
    assert "layers/1/mlp/experts/down_proj/kernel" in matched
    assert not [p for p in matched if "/mlp/gate/" in p or "norm" in p]
    # 5 attention projections per layer, the dense MLP's 3, the routed and shared experts' 6.
    assert len(matched) == 3 * 5 + 3 + 2 * 6


def test_expert_parallel_sharding_equals_one_device():
    """8 devices: the routed experts over "expert" (4), widths and heads (the latent
    projections' included) over "model" (2), in float64 as the other families' tests; every
    weight but the routing bias (no gradient by design) gets a gradient."""
    with jax.enable_x64(True):
        one_layer = {"num_hidden_layers": 1, "mlp_only_layers": ()}  # of experts
        config = DecoderConfig(**{**CONFIG, **one_layer}, dtype="float64", param_dtype="float64")
        graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
        grads = expert_parallel_equals_one_device(
            graphdef, params, TOKENS,
            lambda s: s["layers"][0]["mlp"]["experts"]["gate_proj"]["kernel"],
            rtol=1e-10, atol=1e-12,
        )  # fmt: skip
    for path, grad in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads)):
        name = jax.tree_util.keystr(path)
        assert np.asarray(grad).any() != name.endswith("['e_score_correction_bias']"), name
