"""The `config.json` fields of Hugging Face's Gemma 4 text model (`gemma4_text`)."""

from collections.abc import Callable, Mapping
from typing import Any

from tunelib.models import ROPE_PARAMETERS

# transformers' `Gemma4TextConfig` defaults for the fields a config.json may leave out.
GEMMA4_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "sliding_window": 512,
    "layer_types": None,
    "final_logit_softcapping": None,
    "use_bidirectional_attention": None,
    "vocab_size_per_layer_input": 262_144,
    "hidden_size_per_layer_input": 256,
    "attention_k_eq_v": False,
    "num_kv_shared_layers": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
    "num_experts": None,
    "top_k_experts": None,
    "moe_intermediate_size": None,
    "global_head_dim": 512,
    "num_global_key_value_heads": None,
    "per_layer_config": None,
}
_SLIDING_PATTERN = 6  # transformers' default: five sliding layers, then a full one
_DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1_000_000.0,
    },
}


def gemma4_fields(
    hf: Mapping[str, Any],
    get: Callable[[str], Any],
    rope: Callable[[Mapping[str, Any]], tuple[float, dict[str, Any] | None]],
) -> dict[str, Any]:
    """The `DecoderConfig` fields particular to a Gemma 4 config (`get` reads a field or its
    default; `rope` reads one non-proportional RoPE's `(theta, scaling)`), or a `ValueError`
    naming the field the decoder does not support."""
    activation = get("hidden_activation")
    if activation not in ("gelu_pytorch_tanh", "silu"):
        raise ValueError(
            "config.json: hidden_activation must be 'gelu_pytorch_tanh' or 'silu', got "
            f"{activation!r}."
        )
    if get("use_bidirectional_attention") is not None:
        raise ValueError(
            "config.json: use_bidirectional_attention is "
            f"{get('use_bidirectional_attention')!r}; the decoder is causal only (null)."
        )
    layers = get("num_hidden_layers")
    types = get("layer_types")
    if types is None:
        types = [
            "sliding_attention" if (i + 1) % _SLIDING_PATTERN else "full_attention"
            for i in range(layers)
        ]
    types = list(types)
    if types:  # transformers makes the last layer a full one, whatever the config says
        types[-1] = "full_attention"
    k_eq_v = _flag(get, "attention_k_eq_v")
    global_head_dim, global_kv = _global_attention(hf, get, types, k_eq_v)
    moe = _flag(get, "enable_moe_block")
    per_layer = get("hidden_size_per_layer_input") or 0
    fields = {
        "layer_types": tuple(types),
        "sliding_window": get("sliding_window") if "sliding_attention" in types else None,
        "hidden_act": activation,
        "query_pre_attn_scalar": 1.0,  # Gemma 4 scores are q . k unscaled
        "final_logit_softcapping": get("final_logit_softcapping"),
        "use_qk_norm": True,
        "value_norm": True,
        "sandwich_norms": True,
        "scale_embeddings": True,
        "layer_scalars": True,
        "global_head_dim": global_head_dim,
        "num_global_key_value_heads": global_kv,
        "attention_k_eq_v": k_eq_v,
        "num_kv_shared_layers": get("num_kv_shared_layers"),
        "use_double_wide_mlp": _flag(get, "use_double_wide_mlp"),
        "hidden_size_per_layer_input": per_layer,
        "vocab_size_per_layer_input": get("vocab_size_per_layer_input") if per_layer else None,
        **_rope_fields(hf, rope),
    }
    if moe:
        for name in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            if get(name) is None:
                raise ValueError(f"config.json: enable_moe_block is true, so {name} must be set.")
        fields.update(
            num_experts=get("num_experts"),
            num_experts_per_tok=get("top_k_experts"),
            moe_intermediate_size=get("moe_intermediate_size"),
            norm_topk_prob=True,
            parallel_moe=True,
        )
    return fields


def _flag(get: Callable[[str], Any], name: str) -> bool:
    value = get(name)
    if not isinstance(value, bool):
        raise ValueError(f"config.json: {name} must be true or false, got {value!r}.")
    return value


def _global_attention(
    hf: Mapping[str, Any], get: Callable[[str], Any], types: list[str], k_eq_v: bool
) -> tuple[int, int | None]:
    """`(global_head_dim, num_global_key_value_heads)` from `per_layer_config` (what current
    `transformers` writes) or the top-level fields (what the released checkpoints hold)."""
    overrides = hf.get("per_layer_config")
    if overrides is None:
        global_kv = get("num_global_key_value_heads") if k_eq_v else None
        return get("global_head_dim"), global_kv
    if not isinstance(overrides, Mapping):
        raise ValueError(f"config.json: per_layer_config must be a dict, got {overrides!r}.")
    full = {i for i, t in enumerate(types) if t == "full_attention"}
    seen = set()
    for key, fields in overrides.items():
        layer = int(key)
        if layer not in full or not isinstance(fields, Mapping):
            raise ValueError(
                f"config.json: per_layer_config[{key!r}] overrides a layer that is not a "
                "full-attention layer; only Gemma 4's full-attention head width and key/value "
                "heads may differ."
            )
        extra = set(fields) - {"head_dim", "num_key_value_heads"}
        if extra:
            raise ValueError(
                f"config.json: per_layer_config[{key!r}] overrides {sorted(extra)}; only "
                "head_dim and num_key_value_heads are supported."
            )
        seen.add((fields.get("head_dim", get("head_dim")), fields.get("num_key_value_heads")))
    if not seen:
        return get("head_dim"), None
    if len(seen) > 1 or len(overrides) != len(full):
        raise ValueError(
            "config.json: per_layer_config must give every full-attention layer the same "
            f"head_dim and num_key_value_heads, got {dict(overrides)!r}."
        )
    ((head_dim, kv_heads),) = seen
    return head_dim, kv_heads


def _rope_fields(
    hf: Mapping[str, Any],
    rope: Callable[[Mapping[str, Any]], tuple[float, dict[str, Any] | None]],
) -> dict[str, Any]:
    nested = hf.get("rope_parameters") or _DEFAULT_ROPE
    if not isinstance(nested, Mapping) or set(nested) - set(_DEFAULT_ROPE):
        raise ValueError(
            "config.json: rope_parameters must map 'sliding_attention' and 'full_attention' "
            f"to their RoPE, got {nested!r}."
        )
    local = dict(nested.get("sliding_attention") or _DEFAULT_ROPE["sliding_attention"])
    local.setdefault("rope_theta", 10_000.0)
    if (local.pop("rope_type", None) or "default") != "default" or set(local) != {"rope_theta"}:
        raise ValueError(
            "config.json: rope_parameters['sliding_attention'] must be an unscaled RoPE "
            f"(rope_type 'default' and rope_theta only), got {nested.get('sliding_attention')!r}."
        )
    full = dict(nested.get("full_attention") or _DEFAULT_ROPE["full_attention"])
    fields = {"rope_local_base_freq": float(local["rope_theta"])}
    if full.get("rope_type") != "proportional":
        theta, scaling = rope({"rope_parameters": full})
        return {**fields, "rope_theta": theta, "rope_scaling": scaling}
    extra = set(full) - {"rope_type", "rope_theta", *ROPE_PARAMETERS["proportional"]}
    if extra:
        raise ValueError(
            f"config.json: rope_parameters['full_attention'] has unexpected keys {sorted(extra)}."
        )
    # transformers' defaults (its validator does not list `factor`, its frequencies read it).
    scaling = {
        "rope_type": "proportional",
        "factor": full.get("factor", 1.0),
        "partial_rotary_factor": full.get("partial_rotary_factor", 1.0),
    }
    return {**fields, "rope_theta": full.get("rope_theta", 1_000_000.0), "rope_scaling": scaling}


def gemma4_config(config: Any) -> dict[str, Any]:
    """The Gemma 4 `config.json` fields of a `DecoderConfig`: the full-attention layers'
    head width and key/value heads both as `per_layer_config` (current `transformers`) and as
    `global_head_dim` / `num_global_key_value_heads` (the released checkpoints' layout)."""
    types = config.layer_types or ("full_attention",) * config.num_hidden_layers
    global_head_dim = config.global_head_dim or config.head_dim
    global_kv = config.num_global_key_value_heads
    override = {"head_dim": global_head_dim}
    if global_kv is not None:
        override["num_key_value_heads"] = global_kv
    full = {**(config.rope_scaling or {"rope_type": "default"}), "rope_theta": config.rope_theta}
    if full["rope_type"] == "proportional" and full["factor"] == 1:
        del full["factor"]  # as the released checkpoints; transformers' validator warns on it
    local_theta = config.rope_local_base_freq or config.rope_theta
    moe = config.num_experts > 0
    return {
        "hidden_activation": config.hidden_act,
        "final_logit_softcapping": config.final_logit_softcapping,
        "use_bidirectional_attention": None,
        "sliding_window": config.sliding_window or GEMMA4_DEFAULTS["sliding_window"],
        "layer_types": list(types),
        "rope_parameters": {
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
        },
        "global_head_dim": global_head_dim,
        "num_global_key_value_heads": global_kv,
        "per_layer_config": {
            str(i): override for i, t in enumerate(types) if t == "full_attention"
        },
        "attention_k_eq_v": config.attention_k_eq_v,
        "num_kv_shared_layers": config.num_kv_shared_layers,
        "use_double_wide_mlp": config.use_double_wide_mlp,
        "hidden_size_per_layer_input": config.hidden_size_per_layer_input,
        "vocab_size_per_layer_input": config.vocab_size_per_layer_input,
        "enable_moe_block": moe,
        "num_experts": config.num_experts if moe else None,
        "top_k_experts": config.num_experts_per_tok if moe else None,
        "moe_intermediate_size": config.moe_intermediate_size if moe else None,
    }
