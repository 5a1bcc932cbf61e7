"""The `config.json` fields of Hugging Face's gpt-oss model (`gpt_oss`)."""

from collections.abc import Callable, Mapping
from typing import Any

# transformers' `GptOssConfig` defaults for the fields a config.json may leave out.
GPT_OSS_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 8,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 131_072,
    "sliding_window": 128,
    "layer_types": None,
    "num_experts": 128,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "attention_bias": True,
}
# Its RoPE when `rope_parameters` is left out, and the base `rope_theta` defaults to.
GPT_OSS_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
GPT_OSS_THETA = 150_000.0


def gpt_oss_fields(
    hf: Mapping[str, Any],
    get: Callable[[str], Any],
    rope: Callable[[Mapping[str, Any]], tuple[float, dict[str, Any] | None]],
) -> dict[str, Any]:
    """The `DecoderConfig` fields particular to a gpt-oss config (`get` reads a field or its
    default; `rope` reads `(theta, scaling)` from a dict in either RoPE layout), or a
    `ValueError` naming the field the decoder does not support.

    Every layer is a mixture of `intermediate_size`-wide experts with a biased router and
    biased, clamped-SwiGLU experts, and every attention has sinks; `layer_types` (by default
    sliding, full, sliding, ...) chooses each layer's attention. `hidden_act` is not read
    (transformers' gpt-oss does not read it either: the experts' activation is fixed)."""
    layers = get("num_hidden_layers")
    types = get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(
            "config.json: layer_types may only hold 'sliding_attention' and 'full_attention', "
            f"got {types!r}."
        )
    sliding = "sliding_attention" in types
    if sliding and get("sliding_window") is None:
        raise ValueError(
            "config.json: layer_types has sliding layers, so sliding_window must be set."
        )
    rope_source = {"rope_theta": GPT_OSS_THETA, **hf}
    if not (hf.get("rope_parameters") or hf.get("rope_scaling")):
        rope_source["rope_parameters"] = GPT_OSS_ROPE
    theta, scaling = rope(rope_source)
    return {
        "layer_types": tuple(types),
        "sliding_window": get("sliding_window") if sliding else None,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "attention_sinks": True,
        "num_experts": get("num_experts"),
        "num_experts_per_tok": get("num_experts_per_tok"),
        "moe_intermediate_size": get("intermediate_size"),
        "norm_topk_prob": True,
        "biased_experts": True,
        "swiglu_alpha": get("swiglu_alpha"),
        "swiglu_limit": get("swiglu_limit"),
    }


def gpt_oss_config(config: Any) -> dict[str, Any]:
    """The gpt-oss `config.json` fields of a `DecoderConfig` (beside the common ones)."""
    types = (
        config.layer_types
        or (("sliding_attention" if config.sliding_window else "full_attention"),)
        * config.num_hidden_layers
    )
    return {
        "layer_types": list(types),
        "sliding_window": config.sliding_window,
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "swiglu_alpha": config.swiglu_alpha,
        "swiglu_limit": config.swiglu_limit,
        "attention_bias": config.attention_bias,
    }
