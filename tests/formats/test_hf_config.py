"""Reading Hugging Face `config.json` files of each family (both layouts) and writing them;
each RoPE type's parameters against transformers' own."""

import ast
import contextlib
import logging
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests._helpers import raises_naming
from tests._hf import hf_modules
from tunelib.formats import MODEL_TYPES, config_from_hf, config_to_hf
from tunelib.models import ROPE_PARAMETERS, DecoderConfig, rope_frequencies

SIZES = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
YARN = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "original_max_position_embeddings": 4096,
    "truncate": False,
    "attention_factor": 1.25,
}


def hf(model_type: str, **fields) -> dict:
    return {"model_type": model_type, **SIZES, **fields}


def test_new_and_old_rope_layouts_read_the_same():
    new = hf("llama", rope_parameters={**LLAMA3, "rope_theta": 500000.0})
    old = hf("llama", rope_theta=500000.0, rope_scaling=dict(LLAMA3))
    legacy_key = hf("llama", rope_theta=500000.0, rope_scaling={**LLAMA3, "type": "llama3"})
    del legacy_key["rope_scaling"]["rope_type"]
    configs = [config_from_hf(c) for c in (new, old, legacy_key)]
    assert configs[0] == configs[1] == configs[2]
    assert configs[0].rope_theta == 500000.0 and configs[0].rope_scaling == LLAMA3
    linear_new = hf(
        "qwen2", rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}
    )
    linear_old = hf("qwen2", rope_theta=1e6, rope_scaling={"type": "linear", "factor": 4.0})
    assert config_from_hf(linear_new) == config_from_hf(linear_old)
    assert config_from_hf(linear_new).rope_scaling == {"rope_type": "linear", "factor": 4.0}
    for plain in (
        hf("mistral", rope_theta=1e6),
        hf("mistral", rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    ):
        config = config_from_hf(plain)
        assert config.rope_theta == 1e6 and config.rope_scaling is None
    assert config_from_hf(hf("llama")).rope_theta == 10000.0


def test_llama3_context_defaults_to_max_position_embeddings():
    scaling = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    config = config_from_hf(hf("llama", max_position_embeddings=4096, rope_scaling=scaling))
    assert config.rope_scaling["original_max_position_embeddings"] == 4096


def test_family_specifics():
    llama = config_from_hf(hf("llama", attention_bias=True, mlp_bias=True))
    assert llama.attention_bias and llama.o_proj_bias and llama.mlp_bias and not llama.use_qk_norm
    qwen2 = config_from_hf(hf("qwen2", attention_bias=False, mlp_bias=True))  # keys Qwen2 ignores
    assert qwen2.attention_bias and not qwen2.o_proj_bias and not qwen2.mlp_bias
    qwen3 = config_from_hf(hf("qwen3", attention_bias=True))
    assert qwen3.use_qk_norm and qwen3.o_proj_bias and qwen3.head_dim == 128  # Qwen3's default
    mistral = config_from_hf(hf("mistral", attention_bias=True))
    assert not mistral.attention_bias and mistral.sliding_window == 4096  # Mistral's default
    assert config_from_hf(hf("mistral", sliding_window=None)).sliding_window is None
    # transformers' defaults for fields left out, per family.
    no_kv = {k: v for k, v in SIZES.items() if k != "num_key_value_heads"}
    assert config_from_hf({"model_type": "llama", **no_kv}).num_key_value_heads == 4
    with raises_naming("num_key_value_heads", error=ValueError):  # Mistral's default, 8, > 4
        config_from_hf({"model_type": "mistral", **no_kv})


def test_qwen_sliding_window_on_every_layer_or_an_error():
    assert config_from_hf(hf("qwen2", sliding_window=64)).sliding_window is None  # not used
    every = hf("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=0)
    assert config_from_hf(every).sliding_window == 64
    assert config_from_hf({**every, "max_window_layers": 3}).sliding_window is None
    listed = hf(
        "qwen3", use_sliding_window=True, sliding_window=8, layer_types=["sliding_attention"] * 3
    )
    assert config_from_hf(listed).sliding_window == 8
    with raises_naming("layer_types", "some layers", error=ValueError):
        config_from_hf({**every, "max_window_layers": 1})
    with raises_naming("layer_types", error=ValueError):
        config_from_hf({**listed, "layer_types": ["full_attention"]})


def test_the_checkpoint_dtype_does_not_choose_ours():
    config = config_from_hf(hf("llama", torch_dtype="bfloat16", dtype="bfloat16"))
    assert config.dtype == "float32" and config.param_dtype == "float32"
    config = config_from_hf(
        hf("llama"), dtype="bfloat16", param_dtype="bfloat16", scan_layers=True, remat=True
    )
    assert (config.dtype, config.param_dtype, config.scan_layers, config.remat) == (
        "bfloat16",
        "bfloat16",
        True,
        True,
    )


BAD = [
    ({"model_type": "gemma"}, "model_type"),
    ({"model_type": None}, "model_type"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_dropout": 0.1}, "attention_dropout"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "longrope"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "ramp": 1.0}}, "ramp"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "dynamic"),
    ({"rope_scaling": {"rope_type": "linear"}}, "factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta": 1}}, "beta"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "nested"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config"),
    ({"attention_bias": "yes"}, "attention_bias"),
    ({"num_attention_heads": 3}, "num_attention_heads"),
    ({"rope_theta": "big"}, "rope_theta"),
    ({"sliding_window": 0}, "sliding_window"),
]


@pytest.mark.parametrize(("fields", "named"), BAD)
def test_unsupported_values_are_errors_naming_the_field(fields, named):
    with raises_naming(named, error=ValueError):
        config_from_hf({**hf("mistral" if "sliding_window" in fields else "llama"), **fields})


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_hidden_layers"])
def test_missing_required_field_is_named(field):
    config = hf("qwen3")
    del config[field]
    with raises_naming(field, "missing", error=ValueError):
        config_from_hf(config)


# What Gemma 2 and 3 share.
GEMMA = dict(
    norm_offset=True,
    sandwich_norms=True,
    scale_embeddings=True,
    hidden_act="gelu_pytorch_tanh",
    head_dim=32,
    query_pre_attn_scalar=24,
    final_logit_softcapping=30.0,
    sliding_window=8,
)
EXPRESSIBLE = {
    "llama": dict(attention_bias=True, o_proj_bias=True, mlp_bias=True),
    "mistral": dict(sliding_window=16),
    "qwen2": dict(attention_bias=True, sliding_window=32),
    "qwen3": dict(use_qk_norm=True, head_dim=32, attention_bias=True, o_proj_bias=True),
    "qwen3_moe": dict(
        use_qk_norm=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
        decoder_sparse_step=2,
        mlp_only_layers=(1,),
        sliding_window=8,
    ),
    "gemma2": dict(
        **GEMMA,
        attn_logit_softcapping=50.0,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
    ),
    "gemma3_text": dict(
        **GEMMA,
        use_qk_norm=True,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"),
        rope_local_base_freq=1e4,
    ),
    "gpt_oss": dict(
        attention_bias=True,
        o_proj_bias=True,
        attention_sinks=True,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=96,
        norm_topk_prob=True,
        biased_experts=True,
        swiglu_alpha=1.702,
        swiglu_limit=7.0,
        layer_types=("sliding_attention", "full_attention", "sliding_attention"),
        sliding_window=8,
    ),
    "deepseek_v3": dict(
        head_dim=8,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_nope_head_dim=8,
        v_head_dim=12,
        num_key_value_heads=4,
        rope_interleave=True,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        mlp_only_layers=(0,),
        n_shared_experts=2,
        scoring_func="sigmoid",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    ),
    "qwen3_5_text": dict(
        use_qk_norm=True,
        norm_offset=True,
        attention_output_gate=True,
        partial_rotary_factor=0.25,
        layer_types=("linear_attention", "full_attention", "linear_attention"),
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ),
    "qwen3_5_moe_text": dict(
        use_qk_norm=True,
        norm_offset=True,
        attention_output_gate=True,
        partial_rotary_factor=0.5,
        layer_types=("linear_attention", "linear_attention", "full_attention"),
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=96,
        norm_topk_prob=True,
        shared_expert_intermediate_size=32,
    ),
}


def test_every_family_has_a_round_trip():
    """Gemma 4's round trip is `tests/models/test_gemma4.py`'s; every other family's is below."""
    assert sorted(EXPRESSIBLE) == sorted(set(MODEL_TYPES) - {"gemma4_text"})


@given(
    model_type=st.sampled_from(sorted(EXPRESSIBLE)),
    tie=st.booleans(),
    theta=st.sampled_from([1e4, 5e5, 1e6]),
    scaling=st.sampled_from([None, {"rope_type": "linear", "factor": 2.0}, LLAMA3, YARN]),
    eps=st.sampled_from([1e-5, 1e-6]),
)
def test_config_to_hf_round_trips(model_type, tie, theta, scaling, eps):
    config = DecoderConfig(
        **{**SIZES, **EXPRESSIBLE[model_type]},
        tie_word_embeddings=tie,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=eps,
    )
    written = config_to_hf(config, model_type=model_type, dtype="bfloat16")
    assert written["torch_dtype"] == written["dtype"] == "bfloat16"
    assert config_from_hf(written) == config
    # Either RoPE layout alone reads the same (old and new transformers read one each).
    old = {k: v for k, v in written.items() if k != "rope_parameters"}
    new = {k: v for k, v in written.items() if k not in ("rope_theta", "rope_scaling")}
    assert config_from_hf(old) == config_from_hf(new) == config


def test_config_to_hf_keeps_base_metadata_and_rewrites_architecture():
    base = hf(
        "qwen2",
        bos_token_id=None,
        eos_token_id=151645,
        rope_theta=1.0,
        layer_types=["x"],
        transformers_version="4.40.0",
    )
    config = DecoderConfig(**SIZES, attention_bias=True, rope_theta=1e6)
    written = config_to_hf(config, model_type="qwen2", base=base)
    assert written["eos_token_id"] == 151645 and written["rope_theta"] == 1e6
    assert (
        written["layer_types"] == ["full_attention"] * 3 and "transformers_version" not in written
    )


@pytest.mark.parametrize(
    ("model_type", "overrides", "named"),
    [
        ("llama", {"use_qk_norm": True}, "use_qk_norm"),
        ("llama", {"attention_bias": True}, "o_proj_bias"),
        ("llama", {"sliding_window": 8}, "sliding_window"),
        ("mistral", {"mlp_bias": True}, "mlp_bias"),
        ("qwen2", {}, "attention_bias"),
        ("qwen2", {"attention_bias": True, "o_proj_bias": True}, "o_proj_bias"),
        ("qwen3", {}, "use_qk_norm"),
        ("gemma", {}, "model_type"),
    ],
)
def test_config_to_hf_refuses_what_the_family_cannot_express(model_type, overrides, named):
    config = DecoderConfig(**SIZES, **overrides)
    with raises_naming(named, error=ValueError):
        config_to_hf(config, model_type=model_type)


# One `rope_scaling` of each type in `ROPE_PARAMETERS`, every parameter set: a context of 64
# positions extended to `max_position_embeddings` 256.
ROPE_EXAMPLES = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {**LLAMA3, "original_max_position_embeddings": 64},
    "proportional": {"rope_type": "proportional", "factor": 1.0, "partial_rotary_factor": 0.5},
    "yarn": {**YARN, "factor": 4.0, "original_max_position_embeddings": 64, "mscale_all_dim": 0.5},
}
# A value for each key transformers knows in a `rope_parameters` dict (`RopeParameters`).
TRANSFORMERS_ROPE_VALUES = {
    "rope_theta": 1e4,
    "partial_rotary_factor": 1.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "attention_factor": 1.25,
    "beta_fast": 16.0,
    "beta_slow": 2.0,
    "short_factor": [1.0] * 8,
    "long_factor": [2.0] * 8,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.5,
    "truncate": False,
    "mrope_section": [2, 3, 3],
}
# Gemma 4 is the family whose config.json expresses a proportional RoPE.
GEMMA4 = dict(
    query_pre_attn_scalar=1.0,
    use_qk_norm=True,
    value_norm=True,
    sandwich_norms=True,
    scale_embeddings=True,
    layer_scalars=True,
    hidden_act="gelu_pytorch_tanh",
    tie_word_embeddings=True,
    layer_types=("sliding_attention", "full_attention", "full_attention"),
    sliding_window=8,
    rope_local_base_freq=100.0,
    global_head_dim=16,
)


def rope_model(scaling: dict | None) -> tuple[DecoderConfig, str]:
    """A config with `scaling` (theta 1e4, 256 positions) and the model_type expressing it."""
    gemma4 = scaling is not None and scaling["rope_type"] == "proportional"
    fields = {**SIZES, **(GEMMA4 if gemma4 else {})}
    config = DecoderConfig(
        **fields, max_position_embeddings=256, rope_theta=1e4, rope_scaling=scaling
    )
    return config, "gemma4_text" if gemma4 else "llama"


@contextlib.contextmanager
def rope_messages() -> Iterator[list[str]]:
    """The messages transformers' RoPE validation logs inside the block."""
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("transformers.modeling_rope_utils")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)


def test_every_rope_type_has_an_example():
    assert ROPE_EXAMPLES.keys() == ROPE_PARAMETERS.keys()
    for rope_type, scaling in ROPE_EXAMPLES.items():
        assert set(scaling) == {"rope_type", *ROPE_PARAMETERS[rope_type]}


@pytest.mark.parametrize("rope_type", [None, *ROPE_PARAMETERS])
def test_each_rope_type_round_trips_through_transformers(rope_type):
    """`config_to_hf`'s RoPE reads in transformers without a warning, transformers computes
    our frequencies and attention factor from it, and the config transformers writes back
    reads as the same `DecoderConfig`."""
    _, transformers = hf_modules()
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config, model_type = rope_model(ROPE_EXAMPLES.get(rope_type))
    written = config_to_hf(config, model_type=model_type)
    with rope_messages() as messages:
        theirs = transformers.AutoConfig.for_model(**written)
    assert messages == []
    assert config_from_hf(theirs.to_dict()) == config
    if rope_type is None:
        return
    params = written["rope_parameters"]
    params = dict(params.get("full_attention", params))  # Gemma 4's per layer type
    plain = transformers.LlamaConfig(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters=params,
    )
    frequencies, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](plain, "cpu")
    ours = rope_frequencies(config.head_dim, theta=config.rope_theta, scaling=config.rope_scaling)
    np.testing.assert_allclose(frequencies.numpy(), ours, rtol=1e-6)
    assert attention_factor == pytest.approx(config.rope_scaling.get("attention_factor", 1.0))


def transformers_rope_keys(rope_type: str) -> set[str]:
    """The keys transformers' validation takes in a `rope_type` RoPE besides `rope_type`:
    those of `RopeParameters` it does not log as unrecognized."""
    _, transformers = hf_modules()
    from transformers.modeling_rope_utils import RopeParameters

    every = {key: TRANSFORMERS_ROPE_VALUES[key] for key in RopeParameters.__annotations__
             if key != "rope_type"}  # fmt: skip
    with rope_messages() as messages:
        transformers.LlamaConfig(
            hidden_size=64, num_attention_heads=4, max_position_embeddings=256,
            rope_parameters={"rope_type": rope_type, **every},
        )  # fmt: skip
    unrecognized = [m for m in messages if m.startswith("Unrecognized keys")]
    assert len(unrecognized) == 1, messages  # transformers' message has changed
    return set(every) - ast.literal_eval(unrecognized[0].rpartition(": ")[2])


@pytest.mark.parametrize("rope_type", ["default", *ROPE_PARAMETERS])
def test_every_rope_key_transformers_takes_is_read(rope_type):
    """A RoPE with every key transformers takes for its type reads, each of our parameters
    with the value given; our parameters are among those keys (`factor` is missing from
    transformers' validation of a proportional RoPE, but its frequencies read it)."""
    keys = transformers_rope_keys(rope_type)
    ours = set(ROPE_PARAMETERS.get(rope_type, ()))
    assert ours - keys <= ({"factor"} if rope_type == "proportional" else set())
    params = {"rope_type": rope_type, **{k: TRANSFORMERS_ROPE_VALUES[k] for k in keys}}
    if rope_type == "proportional":
        written = config_to_hf(
            rope_model(ROPE_EXAMPLES["proportional"])[0], model_type="gemma4_text"
        )
        written["rope_parameters"]["full_attention"] = params
    else:
        written = hf("llama", max_position_embeddings=256, rope_parameters=params)
    config = config_from_hf(written)
    assert config.rope_theta == params["rope_theta"]
    scaling = config.rope_scaling or {"rope_type": "default"}
    assert scaling["rope_type"] == rope_type
    assert {k: scaling[k] for k in ours & keys} == {k: params[k] for k in ours & keys}
