"""The `config.json` fields of Hugging Face's Gemma 2 (`gemma2`) and Gemma 3 text
(`gemma3_text`) models."""

from collections.abc import Callable, Mapping
from typing import Any

_SHARED: dict[str, Any] = {
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "layer_types": None,
    "use_bidirectional_attention": False,
}
GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {
        **_SHARED,
        "max_position_embeddings": 8192,
        "sliding_window_pattern": 2,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "gemma3_text": {
        **_SHARED,
        "max_position_embeddings": 131_072,
        "sliding_window_pattern": 6,
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
    },
}
GEMMA_TYPES: tuple[str, ...] = tuple(GEMMA_DEFAULTS)


def gemma_fields(
    model_type: str,
    hf: Mapping[str, Any],
    get: Callable[[str], Any],
    rope: Callable[[Mapping[str, Any]], tuple[float, dict[str, Any] | None]],
) -> dict[str, Any]:
    """The `DecoderConfig` fields particular to a Gemma config (with `get` reading a field or
    its default, and `rope` reading one RoPE's `(theta, scaling)` from a dict in either
    `config.json` layout), or a `ValueError` naming the field the decoder does not support."""
    if get("hidden_activation") != "gelu_pytorch_tanh":
        raise ValueError(
            "config.json: hidden_activation must be 'gelu_pytorch_tanh' (GeGLU), got "
            f"{get('hidden_activation')!r}."
        )
    if get("use_bidirectional_attention"):
        raise ValueError(
            "config.json: use_bidirectional_attention is "
            f"{get('use_bidirectional_attention')!r}; the decoder is causal only."
        )
    if model_type == "gemma3_text" and get("attn_logit_softcapping") is not None:
        raise ValueError(
            f"config.json: attn_logit_softcapping is {get('attn_logit_softcapping')!r}, but "
            "transformers' Gemma 3 never applies it (Gemma 2 does); the decoder refuses it "
            "rather than guess which model is meant."
        )
    layers = get("num_hidden_layers")
    types = get("layer_types")
    if types is None:
        pattern = get("sliding_window_pattern")
        types = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
    fields = {
        "layer_types": tuple(types),
        "sliding_window": get("sliding_window") if "sliding_attention" in types else None,
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": get("query_pre_attn_scalar"),
        "attn_logit_softcapping": get("attn_logit_softcapping"),
        "final_logit_softcapping": get("final_logit_softcapping"),
        "use_qk_norm": model_type == "gemma3_text",
        "norm_offset": True,
        "sandwich_norms": True,
        "scale_embeddings": True,
    }
    if model_type == "gemma2":  # one RoPE for both kinds of layer
        theta, scaling = rope(hf)
        return {**fields, "rope_theta": theta, "rope_scaling": scaling}
    nested = hf.get("rope_parameters") or {}
    if "full_attention" in nested or "sliding_attention" in nested:
        full = dict(nested.get("full_attention") or {})
        local = dict(nested.get("sliding_attention") or {})
    else:  # the older layout: top-level rope_theta, rope_scaling and rope_local_base_freq
        full = {**(hf.get("rope_scaling") or {}), "rope_theta": get("rope_theta")}
        local = {"rope_theta": get("rope_local_base_freq")}
    defaults = GEMMA_DEFAULTS["gemma3_text"]
    full.setdefault("rope_theta", defaults["rope_theta"])
    local.setdefault("rope_theta", defaults["rope_local_base_freq"])
    local_type = local.pop("rope_type", None) or local.pop("type", None) or "default"
    if local_type != "default" or set(local) != {"rope_theta"}:
        raise ValueError(
            "config.json: rope_parameters['sliding_attention'] must be an unscaled RoPE "
            f"(rope_type 'default' and rope_theta only), got {nested.get('sliding_attention')!r}."
        )
    theta, scaling = rope({"rope_parameters": full})
    return {
        **fields,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_local_base_freq": float(local["rope_theta"]),
    }


def gemma_config(model_type: str, config: Any) -> dict[str, Any]:
    """The Gemma-specific `config.json` fields of a `DecoderConfig`. Gemma 3's RoPE is
    written in both layouts (nested `rope_parameters` per layer type for current
    `transformers`, top-level `rope_theta` / `rope_scaling` / `rope_local_base_freq` for
    older ones)."""
    types = (
        config.layer_types
        or (("sliding_attention" if config.sliding_window else "full_attention"),)
        * config.num_hidden_layers
    )
    out = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": config.query_pre_attn_scalar or config.head_dim,
        "attn_logit_softcapping": config.attn_logit_softcapping,
        "final_logit_softcapping": config.final_logit_softcapping,
        "use_bidirectional_attention": False,
        "sliding_window": config.sliding_window,
        "layer_types": list(types),
    }
    if model_type == "gemma2":
        return out
    scaling = dict(config.rope_scaling) if config.rope_scaling else None
    full = {"rope_type": "default", **(scaling or {}), "rope_theta": config.rope_theta}
    local_theta = config.rope_local_base_freq or config.rope_theta
    return {
        **out,
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        "rope_theta": config.rope_theta,
        "rope_scaling": scaling,
        "rope_local_base_freq": local_theta,
    }
