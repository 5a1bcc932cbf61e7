"""The `config.json` fields of Hugging Face's Qwen3.5 text models, dense (`qwen3_5_text`) and
mixture-of-experts (`qwen3_5_moe_text`)."""

from collections.abc import Callable, Mapping
from typing import Any

# transformers' `Qwen3_5TextConfig` defaults for the fields a config.json may leave out.
QWEN3_5_DEFAULTS: dict[str, Any] = {
    "num_key_value_heads": 4,
    "head_dim": 256,
    "max_position_embeddings": 32768,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "layer_types": None,
    "full_attention_interval": 4,
}
# transformers' `Qwen3_5MoeTextConfig` defaults; it has no `intermediate_size` (every layer is
# a mixture of experts), which is read as `moe_intermediate_size`.
QWEN3_5_MOE_DEFAULTS: dict[str, Any] = {
    **QWEN3_5_DEFAULTS,
    "num_key_value_heads": 2,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "num_experts_per_tok": 8,
    "num_experts": 256,
}
MOE_FIELDS: tuple[str, ...] = (
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
)
LINEAR_FIELDS: tuple[str, ...] = (
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
)
# The multimodal RoPE: `mrope_section` is read (`DecoderConfig.mrope_section`); Qwen3.5
# always interleaves its sections, so transformers does not read `mrope_interleaved`.
_MROPE_KEYS = ("mrope_section", "mrope_interleaved")
_LAYER_TYPES = ("linear_attention", "full_attention")


def qwen3_5_fields(
    model_type: str,
    hf: Mapping[str, Any],
    get: Callable[[str], Any],
    rope: Callable[[Mapping[str, Any]], tuple[float, dict[str, Any] | None]],
) -> dict[str, Any]:
    """The `DecoderConfig` fields particular to a Qwen3.5 text config (`get` reads a field or
    its default; `rope` reads `(theta, scaling)` from a dict in either RoPE layout), or a
    `ValueError` naming the field the decoder does not support.

    Layers are Gated DeltaNet (`"linear_attention"`) or gated full-attention layers
    (`layer_types`, by default three linear then one full, `full_attention_interval`); the
    full ones have QK-norm, an output gate and partial RoPE (`partial_rotary_factor`,
    default 0.25, read from `rope_parameters`); every RMSNorm scales by $(1 + g)$. In
    `qwen3_5_moe_text` every layer's MLP is a mixture of `num_experts` experts, top
    `num_experts_per_tok` renormalised, beside a gated shared expert;
    `output_router_logits` and `router_aux_loss_coef` only concern its training loss and
    are not read."""
    layers = get("num_hidden_layers")
    types = get("layer_types")
    if types is None:
        interval = get("full_attention_interval")
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(
                f"config.json: full_attention_interval must be an int >= 1, got {interval!r}."
            )
        types = [_LAYER_TYPES[(i + 1) % interval == 0] for i in range(layers)]
    if isinstance(types, str) or set(types) - set(_LAYER_TYPES):
        raise ValueError(
            f"config.json: layer_types may only hold {list(_LAYER_TYPES)}, got {types!r}."
        )
    rope_source = dict(hf)
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    params = dict(hf.get(field) or {})
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    section = params.get("mrope_section")
    for key in _MROPE_KEYS:
        params.pop(key, None)
    rope_source[field] = params
    rope_source.pop("partial_rotary_factor", None)
    theta, scaling = rope(rope_source)
    experts = {}
    if model_type == "qwen3_5_moe_text":
        experts = {name: get(name) for name in MOE_FIELDS}
        experts["norm_topk_prob"] = True
    return {
        **experts,
        "layer_types": tuple(types),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "partial_rotary_factor": partial,
        "mrope_section": None if section is None else tuple(section),
        "use_qk_norm": True,
        "norm_offset": True,
        "attention_output_gate": True,
        **{name: get(name) for name in LINEAR_FIELDS},
    }


def qwen3_5_config(model_type: str, config: Any) -> dict[str, Any]:
    """The Qwen3.5 `config.json` fields of a `DecoderConfig` (beside the common ones)."""
    experts = {}
    if model_type == "qwen3_5_moe_text":
        experts = {name: getattr(config, name) for name in MOE_FIELDS}
    return {
        **experts,
        "layer_types": list(config.layer_types or ("full_attention",) * config.num_hidden_layers),
        "attention_bias": config.attention_bias,
        **{name: getattr(config, name) for name in LINEAR_FIELDS},
    }
