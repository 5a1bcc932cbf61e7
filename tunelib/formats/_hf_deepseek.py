"""The `config.json` fields of Hugging Face's DeepSeek-V3 model (`deepseek_v3`)."""

from collections.abc import Callable, Mapping
from typing import Any

# transformers' `DeepseekV3Config` defaults for the fields a config.json may leave out.
DEEPSEEK_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 128,
    "max_position_embeddings": 4096,
    "moe_intermediate_size": 2048,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "rope_interleave": True,
}
# Keys of DeepSeek's own config.json (its remote code's) that transformers does not read but
# that name a variant: only the value DeepSeek-V3 uses, which transformers computes, loads.
DEEPSEEK_VARIANTS: dict[str, Any] = {
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "moe_layer_freq": 1,
}


def deepseek_fields(
    hf: Mapping[str, Any],
    get: Callable[[str], Any],
    rope: Callable[[Mapping[str, Any]], tuple[float, dict[str, Any] | None]],
) -> dict[str, Any]:
    """The `DecoderConfig` fields particular to a DeepSeek-V3 config (`get` reads a field or
    its default; `rope` reads `(theta, scaling)`), or a `ValueError` naming the field the
    decoder does not support.

    Every layer attends by multi-head latent attention; the first `first_k_dense_replace`
    layers have the dense MLP (`mlp_only_layers`) and the others DeepSeekMoE (sigmoid
    routing, `scoring_func="sigmoid"`). `head_dim` and `qk_head_dim` are derived by
    transformers (from `qk_rope_head_dim` and `qk_nope_head_dim`) and not read. DeepSeek's
    own `scoring_func`, `topk_method` and `moe_layer_freq`, when present, must be DeepSeek-V3's
    (`DEEPSEEK_VARIANTS`)."""
    heads, kv_heads = get("num_attention_heads"), get("num_key_value_heads")
    if kv_heads is not None and kv_heads != heads:
        raise ValueError(
            f"config.json: num_key_value_heads is {kv_heads!r}; DeepSeek-V3's latent attention "
            f"has one key and value per query head, so it must equal num_attention_heads "
            f"({heads})."
        )
    for name, value in DEEPSEEK_VARIANTS.items():
        if hf.get(name, value) != value:
            raise ValueError(
                f"config.json: {name} is {hf[name]!r}; DeepSeek-V3 (as transformers computes "
                f"it) has only {name}={value!r}."
            )
    layers, dense = get("num_hidden_layers"), get("first_k_dense_replace")
    if isinstance(dense, bool) or not isinstance(dense, int) or dense < 0:
        raise ValueError(f"config.json: first_k_dense_replace must be an int >= 0, got {dense!r}.")
    interleave = get("rope_interleave")
    if not isinstance(interleave, bool):
        raise ValueError(f"config.json: rope_interleave must be true or false, got {interleave!r}.")
    norm = get("norm_topk_prob")
    if not isinstance(norm, bool):
        raise ValueError(f"config.json: norm_topk_prob must be true or false, got {norm!r}.")
    theta, scaling = rope(hf)
    return {
        "num_key_value_heads": heads,
        "head_dim": get("qk_rope_head_dim"),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "kv_lora_rank": get("kv_lora_rank"),
        "q_lora_rank": get("q_lora_rank"),
        "qk_nope_head_dim": get("qk_nope_head_dim"),
        "v_head_dim": get("v_head_dim"),
        "rope_interleave": interleave,
        "num_experts": get("n_routed_experts"),
        "num_experts_per_tok": get("num_experts_per_tok"),
        "moe_intermediate_size": get("moe_intermediate_size"),
        "norm_topk_prob": norm,
        "mlp_only_layers": tuple(range(min(dense, layers))),
        "n_shared_experts": get("n_shared_experts"),
        "scoring_func": "sigmoid",
        "n_group": get("n_group"),
        "topk_group": get("topk_group"),
        "routed_scaling_factor": get("routed_scaling_factor"),
    }


def deepseek_config(config: Any) -> dict[str, Any]:
    """The DeepSeek-V3 `config.json` fields of a `DecoderConfig` (beside the common ones)."""
    return {
        "kv_lora_rank": config.kv_lora_rank,
        "q_lora_rank": config.q_lora_rank,
        "qk_rope_head_dim": config.head_dim,
        "qk_nope_head_dim": config.qk_nope_head_dim,
        "v_head_dim": config.v_head_dim,
        "rope_interleave": config.rope_interleave,
        "n_routed_experts": config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "norm_topk_prob": config.norm_topk_prob,
        "first_k_dense_replace": len(config.mlp_only_layers),
        "n_shared_experts": config.n_shared_experts,
        "n_group": config.n_group,
        "topk_group": config.topk_group,
        "routed_scaling_factor": config.routed_scaling_factor,
        "attention_bias": config.attention_bias,
    }


def deepseek_expressible(config: Any) -> dict[str, Any]:
    """The values a `DecoderConfig` needs for DeepSeek-V3 to express it, by field."""
    dense = len(config.mlp_only_layers)
    return {
        "kv_lora_rank": config.kv_lora_rank or "an int (multi-head latent attention)",
        "scoring_func": "sigmoid",
        "decoder_sparse_step": 1,
        "mlp_only_layers": tuple(range(dense)),
        "sliding_window": None,
        "mlp_bias": False,
    }
