"""Reading and writing the `config.json` of a Hugging Face Llama / Mistral / Qwen2 / Qwen3 /
Qwen3-MoE / Gemma 2, 3, 4 / gpt-oss / DeepSeek-V3 / Qwen3.5 text."""

import math
from collections.abc import Callable, Mapping
from typing import Any

from tunelib.formats._hf_deepseek import (
    DEEPSEEK_DEFAULTS,
    deepseek_config,
    deepseek_expressible,
    deepseek_fields,
)
from tunelib.formats._hf_gemma import GEMMA_DEFAULTS, GEMMA_TYPES, gemma_config, gemma_fields
from tunelib.formats._hf_gemma4 import GEMMA4_DEFAULTS, gemma4_config, gemma4_fields
from tunelib.formats._hf_gpt_oss import GPT_OSS_DEFAULTS, gpt_oss_config, gpt_oss_fields
from tunelib.formats._hf_qwen3_5 import (
    QWEN3_5_DEFAULTS,
    QWEN3_5_MOE_DEFAULTS,
    qwen3_5_config,
    qwen3_5_fields,
)
from tunelib.models import DTYPE_NAMES, ROPE_PARAMETERS, DecoderConfig

# The `architectures` entry each supported `model_type` has in a causal-LM checkpoint.
ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
QWEN3_5_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")
MODEL_TYPES: tuple[str, ...] = tuple(ARCHITECTURES)

# transformers' defaults (its config classes) for the fields a config.json may leave out; None
# for num_key_value_heads and head_dim means "derive it" (N, and H / N).
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048},
    "mistral": {
        "num_key_value_heads": 8,
        "head_dim": None,
        "max_position_embeddings": 4096 * 32,
        "sliding_window": 4096,
    },
    "qwen2": {"num_key_value_heads": 32, "head_dim": None, "max_position_embeddings": 32768},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768},
    "qwen3_moe": {
        "num_key_value_heads": 4,
        "head_dim": None,
        "max_position_embeddings": 32768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": None,
    },
    **GEMMA_DEFAULTS,
    "gemma4_text": GEMMA4_DEFAULTS,
    "gpt_oss": GPT_OSS_DEFAULTS,
    "deepseek_v3": DEEPSEEK_DEFAULTS,
    "qwen3_5_text": QWEN3_5_DEFAULTS,
    "qwen3_5_moe_text": QWEN3_5_MOE_DEFAULTS,
}
_COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": 4096,
    "max_window_layers": 28,
    "layer_types": None,
}
_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
# The RoPE types `_rope` reads: transformers' "default" (plain RoPE, `rope_scaling` None) and
# those of `ROPE_PARAMETERS` but Gemma 4's proportional one, which `gemma4_fields` reads.
_ROPE_TYPES = ("default", *(t for t in ROPE_PARAMETERS if t != "proportional"))


def config_from_hf(
    hf_config: Mapping[str, Any],
    *,
    dtype: str = "float32",
    param_dtype: str = "float32",
    scan_layers: bool = False,
    remat: bool = False,
) -> DecoderConfig:
    """The `DecoderConfig` of a Hugging Face `config.json` (Llama, Mistral, Qwen2, Qwen3,
    Qwen3-MoE, Gemma 2, Gemma 3 text, Gemma 4 text, gpt-oss, DeepSeek-V3, Qwen3.5 text and
    Qwen3.5-MoE text).

    Reads the fields that the `transformers` model of the config's `model_type` reads, with
    `transformers`' defaults for the ones left out, so the decoder computes what that model
    computes. Both config layouts load: current `transformers` releases write RoPE settings
    as `rope_parameters = {"rope_type", "rope_theta", ...}`, older ones as top-level
    `rope_theta` and `rope_scaling`. The families differ as in `transformers`:

    | `model_type` | biases | QK-norm | sliding window |
    |---|---|---|---|
    | `llama` | q/k/v/o with `attention_bias`, MLP with `mlp_bias` | no | no |
    | `mistral` | none | no | `sliding_window` (default 4096) |
    | `qwen2` | q/k/v always | no | `use_sliding_window`, all layers |
    | `qwen3` | q/k/v/o with `attention_bias` | yes | `use_sliding_window`, all layers |
    | `qwen3_moe` | q/k/v/o with `attention_bias` | yes | `use_sliding_window`, all layers |
    | `gemma2` | q/k/v/o with `attention_bias` | no | `layer_types` (alternating) |
    | `gemma3_text` | q/k/v/o with `attention_bias` | yes | `layer_types` (5 sliding : 1) |
    | `gemma4_text` | q/k/v/o with `attention_bias` | yes, and values | `layer_types` |
    | `gpt_oss` | q/k/v/o with `attention_bias` (default true) | no | `layer_types` |
    | `deepseek_v3` | `q_a_proj`, `kv_a_proj_with_mqa`, o with `attention_bias` | no | no |
    | `qwen3_5_text` | q/k/v/o with `attention_bias` | yes | no (Gated DeltaNet or full) |
    | `qwen3_5_moe_text` | q/k/v/o with `attention_bias` | yes | no (Gated DeltaNet or full) |

    Gemma 4's fields (`global_head_dim` or `per_layer_config`, `attention_k_eq_v`,
    `num_kv_shared_layers`, `use_double_wide_mlp`, the per-layer inputs, `enable_moe_block`
    with `num_experts`, `top_k_experts`, `moe_intermediate_size`, proportional RoPE) are each
    read or refused by name; the table is in `docs/models.md`.

    gpt-oss adds attention sinks, a biased router and biased clamped-SwiGLU experts
    (`swiglu_alpha`, `swiglu_limit`, `num_local_experts`, `num_experts_per_tok`, experts
    `intermediate_size` wide) and YaRN RoPE by default; its table is in `docs/models.md`.

    DeepSeek-V3 adds multi-head latent attention (`kv_lora_rank`, `q_lora_rank`,
    `qk_nope_head_dim`, `qk_rope_head_dim`, `v_head_dim`, `rope_interleave`) and DeepSeekMoE
    (`n_routed_experts`, `n_shared_experts`, `n_group`, `topk_group`,
    `routed_scaling_factor`, `first_k_dense_replace`); its table is in `docs/models.md`.
    Qwen3.5 text mixes Gated DeltaNet layers (`linear_conv_kernel_dim`,
    `linear_key_head_dim`, `linear_value_head_dim`, `linear_num_key_heads`,
    `linear_num_value_heads`) with gated full-attention layers of partial RoPE
    (`partial_rotary_factor`); Qwen3.5-MoE adds Qwen3-MoE's experts and a gated shared expert
    (`shared_expert_intermediate_size`) in every layer; the tables are in `docs/models.md`.

    Qwen3-MoE's experts come from `num_experts` (or `num_local_experts`, the name
    `transformers` saves it under), `num_experts_per_tok`, `moe_intermediate_size`,
    `norm_topk_prob`, `decoder_sparse_step` and `mlp_only_layers`; `output_router_logits` and
    `router_aux_loss_coef` only concern its training loss and are not read.

    A value the decoder cannot reproduce is an error naming the field, never ignored: an
    activation other than the family's, dropout, a RoPE type other than default / linear /
    llama3 / yarn (and Gemma 4's proportional one), partial rotary embeddings elsewhere, sliding
    windows on some layers only outside the Gemma families, or quantised weights.
    Keys the `transformers` model does not read (token ids, `torch_dtype`, generation
    settings) are ignored, as there.

    Args:
      hf_config: the parsed `config.json`.
      dtype: the compute dtype, chosen by the caller (the checkpoint's `torch_dtype` / `dtype`
        is only its storage dtype).
      param_dtype: the dtype the weights are stored in.
      scan_layers: store the layers stacked (see `DecoderConfig`).
      remat: rematerialise each layer in the backward pass.

    Returns:
      The `DecoderConfig`.

    Raises:
      ValueError: naming the field, for a missing required field, an unsupported
        `model_type`, or a value the decoder does not support.

    Examples:
      >>> from tunelib.formats import config_from_hf
      >>> hf = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64,
      ...       "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
      ...       "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
      ...                           "factor": 8.0, "low_freq_factor": 1.0,
      ...                           "high_freq_factor": 4.0,
      ...                           "original_max_position_embeddings": 64}}
      >>> config = config_from_hf(hf)
      >>> config.num_key_value_heads, config.head_dim, config.rope_theta
      (4, 16, 500000.0)
      >>> config.rope_scaling["rope_type"]
      'llama3'
      >>> old = {**hf, "rope_theta": 500000.0, "rope_scaling": hf["rope_parameters"]}
      >>> del old["rope_parameters"], old["rope_scaling"]["rope_theta"]
      >>> config_from_hf(old) == config
      True
    """
    if not isinstance(hf_config, Mapping):
        raise TypeError(f"hf_config must be a dict, got {type(hf_config).__name__}.")
    model_type = hf_config.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"config.json: model_type must be one of {MODEL_TYPES}, got {model_type!r}."
        )
    architectures = hf_config.get("architectures")
    if architectures is not None and list(architectures) != [ARCHITECTURES[model_type]]:
        raise ValueError(
            f"config.json: architectures is {architectures!r}; only the causal LM "
            f"[{ARCHITECTURES[model_type]!r}] is supported for model_type {model_type!r}."
        )
    # Qwen3.5-MoE has no dense MLP: `transformers` does not read `intermediate_size` (its
    # config has none), so it is the experts' width here.
    if model_type == "qwen3_5_moe_text":
        default = QWEN3_5_MOE_DEFAULTS["moe_intermediate_size"]
        width = hf_config.get("moe_intermediate_size", default)
        hf_config = {**hf_config, "intermediate_size": width}
    for name in _REQUIRED:
        if name not in hf_config:
            raise ValueError(f"config.json: the required field {name!r} is missing.")
    if hf_config.get("quantization_config") is not None:
        raise ValueError(
            "config.json: quantization_config is set; quantised checkpoints are not supported."
        )

    # transformers saves Qwen3-MoE's expert count under its attribute_map name.
    if "num_experts" not in hf_config and "num_local_experts" in hf_config:
        hf_config = {**hf_config, "num_experts": hf_config["num_local_experts"]}

    def get(name: str) -> Any:
        value = hf_config.get(name)
        if value is None and name not in hf_config:
            return _DEFAULTS[model_type].get(name, _COMMON_DEFAULTS.get(name))
        return value

    gemma = (*GEMMA_TYPES, "gemma4_text")
    unread_act = (*gemma, "gpt_oss")  # Gemma reads hidden_activation; gpt-oss neither
    if model_type not in unread_act and get("hidden_act") not in ("silu", "swish"):
        raise ValueError(
            f"config.json: hidden_act must be 'silu' (SwiGLU), got {get('hidden_act')!r}."
        )
    if get("attention_dropout") not in (0, 0.0):
        raise ValueError(
            f"config.json: attention_dropout is {get('attention_dropout')!r}; the decoder has no "
            "dropout, so only 0 is supported."
        )
    max_positions = get("max_position_embeddings")
    if model_type in GEMMA_TYPES:
        family = gemma_fields(model_type, hf_config, get, lambda hf: _rope(hf, max_positions))
    elif model_type == "gemma4_text":
        family = gemma4_fields(hf_config, get, lambda hf: _rope(hf, max_positions))
    elif model_type == "gpt_oss":
        family = gpt_oss_fields(hf_config, get, lambda hf: _rope(hf, max_positions))
    elif model_type == "deepseek_v3":
        family = deepseek_fields(hf_config, get, lambda hf: _rope(hf, max_positions))
    elif model_type in QWEN3_5_TYPES:
        family = qwen3_5_fields(model_type, hf_config, get, lambda hf: _rope(hf, max_positions))
    else:
        theta, scaling = _rope(hf_config, max_positions)
        family = {
            "rope_theta": theta,
            "rope_scaling": scaling,
            "use_qk_norm": model_type in ("qwen3", "qwen3_moe"),
            "sliding_window": _sliding_window(model_type, get),
        }

    biases = {"attention_bias": False, "o_proj_bias": False, "mlp_bias": False}
    if model_type == "llama":
        bias = _bool(get("attention_bias"), "attention_bias")
        biases = {
            "attention_bias": bias,
            "o_proj_bias": bias,
            "mlp_bias": _bool(get("mlp_bias"), "mlp_bias"),
        }
    elif model_type == "qwen2":
        biases["attention_bias"] = True
    elif model_type in ("qwen3", "qwen3_moe", "gpt_oss", "deepseek_v3", *QWEN3_5_TYPES, *gemma):
        bias = _bool(get("attention_bias"), "attention_bias")
        biases.update(attention_bias=bias, o_proj_bias=bias)
    experts = {}
    if model_type == "qwen3_moe":
        experts = {
            name: get(name)
            for name in (
                "num_experts",
                "num_experts_per_tok",
                "moe_intermediate_size",
                "decoder_sparse_step",
            )
        }
        experts["norm_topk_prob"] = _bool(get("norm_topk_prob"), "norm_topk_prob")
        experts["mlp_only_layers"] = tuple(get("mlp_only_layers") or ())

    common = {"num_key_value_heads": get("num_key_value_heads"), "head_dim": get("head_dim")}
    return DecoderConfig(
        vocab_size=get("vocab_size"),
        hidden_size=get("hidden_size"),
        intermediate_size=get("intermediate_size"),
        num_hidden_layers=get("num_hidden_layers"),
        num_attention_heads=get("num_attention_heads"),
        rms_norm_eps=get("rms_norm_eps"),
        max_position_embeddings=get("max_position_embeddings"),
        tie_word_embeddings=get("tie_word_embeddings"),
        initializer_range=get("initializer_range"),
        scan_layers=scan_layers,
        remat=remat,
        dtype=dtype,
        param_dtype=param_dtype,
        **biases,
        **experts,
        **{**common, **family},
    )


def config_to_hf(
    config: DecoderConfig,
    *,
    model_type: str,
    base: Mapping[str, Any] | None = None,
    dtype: str | None = None,
) -> dict[str, Any]:
    """The `config.json` dict of `config` for a Hugging Face `model_type`.

    Starts from `base` (for example the `config.json` a checkpoint was loaded from, so token
    ids and other metadata survive) and writes every architectural field. RoPE settings are
    written in both layouts, `rope_parameters` for current `transformers` releases and
    top-level `rope_theta` / `rope_scaling` for older ones, so either reads the same model.

    Args:
      config: the decoder's config.
      model_type: one of `MODEL_TYPES`; the config must be one this family can express
        (Qwen2 needs q/k/v biases and no output bias, Qwen3 needs QK-norm, only Qwen3-MoE
        has experts, ...).
      base: fields to start from; architectural ones are overwritten.
      dtype: the storage dtype of the saved weights, written as `torch_dtype` and `dtype`;
        None means `config.param_dtype`.

    Returns:
      A JSON-serialisable dict.

    Raises:
      ValueError: naming the field that `model_type` cannot express.

    Examples:
      >>> from tunelib.formats import config_from_hf, config_to_hf
      >>> from tunelib.models import DecoderConfig
      >>> config = DecoderConfig(vocab_size=128, hidden_size=64, intermediate_size=96,
      ...                        num_hidden_layers=2, num_attention_heads=4,
      ...                        num_key_value_heads=2, attention_bias=True)
      >>> hf = config_to_hf(config, model_type="qwen2")
      >>> hf["architectures"], hf["rope_parameters"]
      (['Qwen2ForCausalLM'], {'rope_type': 'default', 'rope_theta': 10000.0})
      >>> config_from_hf(hf) == config
      True
    """
    if model_type not in MODEL_TYPES:
        raise ValueError(f"model_type must be one of {MODEL_TYPES}, got {model_type!r}.")
    dtype = config.param_dtype if dtype is None else dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {dtype!r}.")
    _check_expressible(config, model_type)
    out = dict(base or {})
    stale_keys = (
        "rope_scaling",
        "rope_parameters",
        "rope_theta",
        "layer_types",
        "rope_type",
        "partial_rotary_factor",
    )
    for stale in (*stale_keys, "transformers_version", "num_local_experts"):
        out.pop(stale, None)
    scaling = None if config.rope_scaling is None else dict(config.rope_scaling)
    out.update(
        architectures=[ARCHITECTURES[model_type]],
        model_type=model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
        tie_word_embeddings=config.tie_word_embeddings,
        attention_dropout=0.0,
        rope_theta=config.rope_theta,
        rope_scaling=scaling,
        rope_parameters={
            "rope_type": "default" if scaling is None else scaling["rope_type"],
            "rope_theta": config.rope_theta,
            **({} if scaling is None else {k: x for k, x in scaling.items() if k != "rope_type"}),
        },
        torch_dtype=dtype,
        dtype=dtype,
    )
    if model_type not in (*GEMMA_TYPES, "gemma4_text"):
        out.update(hidden_act="silu")
    if model_type == "gpt_oss":
        out.update(**gpt_oss_config(config), intermediate_size=config.moe_intermediate_size)
    if model_type == "deepseek_v3":
        out.update(deepseek_config(config))
    if model_type in QWEN3_5_TYPES:
        # Both layouts: `rope_parameters` holds it, older releases read it at the top.
        fields = qwen3_5_config(model_type, config)
        out.update(**fields, partial_rotary_factor=config.partial_rotary_factor)
        if model_type == "qwen3_5_moe_text":
            del out["intermediate_size"]
        out["rope_parameters"]["partial_rotary_factor"] = config.partial_rotary_factor
        if config.mrope_section is not None:
            out["rope_parameters"].update(
                mrope_section=list(config.mrope_section), mrope_interleaved=True
            )
    if model_type == "llama":
        out.update(attention_bias=config.attention_bias, mlp_bias=config.mlp_bias)
    elif model_type in GEMMA_TYPES:
        out.update(attention_bias=config.attention_bias, **gemma_config(model_type, config))
    elif model_type == "gemma4_text":
        out.update(attention_bias=config.attention_bias, **gemma4_config(config))
        del out["rope_theta"], out["rope_scaling"]
    elif model_type == "mistral":
        out.update(sliding_window=config.sliding_window)
    elif model_type not in ("gpt_oss", "deepseek_v3", *QWEN3_5_TYPES):
        sliding = config.sliding_window is not None
        out.update(
            use_sliding_window=sliding,
            sliding_window=config.sliding_window,
            max_window_layers=0 if sliding else config.num_hidden_layers,
            layer_types=[("sliding" if sliding else "full") + "_attention"]
            * config.num_hidden_layers,
        )
        if model_type in ("qwen3", "qwen3_moe"):
            out.update(attention_bias=config.attention_bias)
        if model_type == "qwen3_moe":
            del out["max_window_layers"], out["layer_types"]
            out.update(
                num_experts=config.num_experts,
                num_experts_per_tok=config.num_experts_per_tok,
                moe_intermediate_size=config.moe_intermediate_size,
                norm_topk_prob=config.norm_topk_prob,
                decoder_sparse_step=config.decoder_sparse_step,
                mlp_only_layers=list(config.mlp_only_layers),
            )
    return out


def _check_expressible(config: DecoderConfig, model_type: str) -> None:
    """Raise naming the first field of `config` that `model_type` cannot express."""
    gemma4 = model_type == "gemma4_text"
    gemma = model_type in GEMMA_TYPES or gemma4
    gpt_oss = model_type == "gpt_oss"
    if model_type == "deepseek_v3":
        _check_needs(config, model_type, deepseek_expressible(config))
    else:
        _check_needs(config, model_type, {"kv_lora_rank": None, "scoring_func": "softmax"})
    qwen3_5 = model_type in QWEN3_5_TYPES
    qwen3_5_moe = model_type == "qwen3_5_moe_text"
    need: dict[str, Any] = {
        "attention_sinks": gpt_oss,
        "biased_experts": gpt_oss,
        "use_qk_norm": model_type
        in ("qwen3", "qwen3_moe", "gemma3_text", "gemma4_text", *QWEN3_5_TYPES),
        "norm_offset": (gemma and not gemma4) or qwen3_5,
        "attention_output_gate": qwen3_5,
        "sandwich_norms": gemma,
        "scale_embeddings": gemma,
        "value_norm": gemma4,
        "layer_scalars": gemma4,
        "parallel_moe": gemma4 and config.num_experts > 0,
    }
    if not gemma:
        need["hidden_act"] = "silu"
    elif not gemma4:
        need["hidden_act"] = "gelu_pytorch_tanh"
    if model_type not in ("qwen3_moe", "gemma4_text", "gpt_oss", "deepseek_v3", "qwen3_5_moe_text"):
        need["num_experts"] = 0
    if not qwen3_5_moe:
        need["shared_expert_intermediate_size"] = 0
    else:
        need.update(
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=(),
            intermediate_size=config.moe_intermediate_size,
        )
        if not config.num_experts:
            raise ValueError(
                "model_type 'qwen3_5_moe_text' cannot express num_experts=0 (it needs experts "
                "in every layer); use qwen3_5_text."
            )
    if gpt_oss:
        need.update(
            moe_intermediate_size=config.intermediate_size,
            decoder_sparse_step=1,
            mlp_only_layers=(),
        )
    if not qwen3_5:
        if any(config.linear_layers):
            raise ValueError(
                f"model_type {model_type!r} cannot express layer_types with 'linear_attention' "
                "layers; only qwen3_5_text and qwen3_5_moe_text can."
            )
        for name, plain in (("partial_rotary_factor", 1), ("mrope_section", None)):
            if getattr(config, name) != plain:
                raise ValueError(
                    f"model_type {model_type!r} cannot express {name}="
                    f"{getattr(config, name)!r}; only qwen3_5_text and qwen3_5_moe_text can."
                )
    else:
        need.update(sliding_window=None, mlp_bias=False)
    if not gemma4:
        need.update(
            global_head_dim=None,
            num_global_key_value_heads=None,
            attention_k_eq_v=False,
            num_kv_shared_layers=0,
            use_double_wide_mlp=False,
            hidden_size_per_layer_input=0,
        )
        if config.rope_scaling and config.rope_scaling["rope_type"] == "proportional":
            raise ValueError(
                f"model_type {model_type!r} cannot express the proportional RoPE of "
                "rope_scaling; only gemma4_text can."
            )
    else:
        need.update(
            query_pre_attn_scalar=1.0,
            attn_logit_softcapping=None,
            decoder_sparse_step=1,
            mlp_only_layers=(),
            norm_topk_prob=config.num_experts > 0 or config.norm_topk_prob,
        )
    if not gemma:
        need.update(
            query_pre_attn_scalar=None,
            rope_local_base_freq=None,
            attn_logit_softcapping=None,
            final_logit_softcapping=None,
        )
        if len(set(config.sliding_layers)) > 1 and not gpt_oss:
            raise ValueError(
                f"model_type {model_type!r} cannot express layer_types mixing sliding and full "
                "layers; only the Gemma families and gpt_oss can."
            )
    elif model_type == "gemma2":
        need.update(rope_local_base_freq=None)
    elif not gemma4:
        need.update(attn_logit_softcapping=None)
    if model_type == "llama":
        need.update(o_proj_bias=config.attention_bias, sliding_window=None)
    elif model_type == "mistral":
        need.update(attention_bias=False, o_proj_bias=False, mlp_bias=False)
    elif model_type == "qwen2":
        need.update(attention_bias=True, o_proj_bias=False, mlp_bias=False)
    else:
        need.update(o_proj_bias=config.attention_bias, mlp_bias=False)
    _check_needs(config, model_type, need)


def _check_needs(config: DecoderConfig, model_type: str, need: Mapping[str, Any]) -> None:
    for name, value in need.items():
        if getattr(config, name) != value:
            raise ValueError(
                f"model_type {model_type!r} cannot express {name}={getattr(config, name)!r} "
                f"(it needs {name}={value!r} with this config)."
            )


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"config.json: {name} must be true or false, got {value!r}.")
    return value


def _rope(hf: Mapping[str, Any], max_positions: int) -> tuple[float, dict[str, Any] | None]:
    """`(rope_theta, rope_scaling)` from either config layout, as `transformers` reads them."""
    nested = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    if not isinstance(nested, Mapping):
        raise ValueError(f"config.json: {field} must be a dict, got {nested!r}.")
    params = dict(nested)
    if any(isinstance(x, Mapping) for x in params.values()):
        raise ValueError(
            f"config.json: {field} is nested per layer type ({sorted(params)}); only one RoPE "
            "for every layer is supported."
        )
    theta = params.pop("rope_theta", None)
    theta = hf.get("rope_theta", 10000.0) if theta is None else theta
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    partial = params.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (1, 1.0, None):
        raise ValueError(
            f"config.json: partial_rotary_factor is {partial!r}; only full rotary embeddings "
            "(1.0) are supported."
        )
    if rope_type not in _ROPE_TYPES:
        raise ValueError(
            f"config.json: {field} has rope_type {rope_type!r}; supported: {_ROPE_TYPES}."
        )
    expected = set(ROPE_PARAMETERS.get(rope_type, ()))
    if "original_max_position_embeddings" in expected:  # transformers' default
        params.setdefault("original_max_position_embeddings", max_positions)
    if rope_type == "yarn":  # keys left out filled in, an unexpected one an error
        params = _yarn(params, max_positions)
    elif set(params) != expected:
        extra, missing = sorted(set(params) - expected), sorted(expected - set(params))
        raise ValueError(
            f"config.json: {field} of rope_type {rope_type!r} has unexpected keys {extra} and "
            f"lacks {missing}."
        )
    if not isinstance(theta, int | float) or not math.isfinite(theta):
        raise ValueError(f"config.json: rope_theta must be a number, got {theta!r}.")
    if rope_type == "default":
        return float(theta), None
    return float(theta), {"rope_type": rope_type, **params}


def _yarn(params: dict[str, Any], max_positions: int) -> dict[str, Any]:
    """A YaRN `rope_parameters` dict as `DecoderConfig.rope_scaling` holds it: the keys
    `transformers` derives when left out (`beta_fast` 32, `beta_slow` 1, `truncate` true,
    `factor` from the context lengths, `attention_factor` from `factor`, `mscale` and
    `mscale_all_dim`) filled in, or an error naming an unexpected key."""
    extra = sorted(set(params) - {*ROPE_PARAMETERS["yarn"], "mscale"})
    if extra:
        raise ValueError(
            f"config.json: rope_parameters of rope_type 'yarn' has unexpected keys {extra}."
        )
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_positions / original
    if not isinstance(factor, int | float) or isinstance(factor, bool):
        raise ValueError(
            f"config.json: rope_parameters['factor'] must be a number, got {factor!r}."
        )
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = _yarn_attention_factor(
            factor, params.get("mscale"), params.get("mscale_all_dim")
        )
    # Multi-head latent attention's softmax scale reads it (`DecoderConfig.rope_scaling`).
    all_dim = {"mscale_all_dim": params["mscale_all_dim"]} if params.get("mscale_all_dim") else {}
    return {
        **all_dim,
        "factor": factor,
        "beta_fast": params.get("beta_fast") or 32.0,
        "beta_slow": params.get("beta_slow") or 1.0,
        "original_max_position_embeddings": original,
        "truncate": _bool(params.get("truncate", True), "rope_parameters['truncate']"),
        "attention_factor": attention_factor,
    }


def _yarn_attention_factor(
    factor: float, mscale: float | None, mscale_all_dim: float | None
) -> float:
    r"""YaRN's default `attention_factor`, as `transformers` derives it: with
    $m(s, a) = 0.1\, a \ln s + 1$ ($1$ for $s \le 1$), $m(s, 1)$, or
    $m(s, \mathrm{mscale}) / m(s, \mathrm{mscale\_all\_dim})$ when both are set."""

    def m(scale: float, a: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * a * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return m(factor, mscale) / m(factor, mscale_all_dim)
    return m(factor)


def _sliding_window(model_type: str, get: Callable[[str], Any]) -> int | None:
    """The window every layer uses, or None; an error when only some layers slide."""
    if model_type == "llama":
        return None
    if model_type == "mistral":
        return get("sliding_window")
    window = (
        get("sliding_window") if _bool(get("use_sliding_window"), "use_sliding_window") else None
    )
    if model_type == "qwen3_moe":  # one window for all layers, or none
        return window
    layers = get("num_hidden_layers")
    types = get("layer_types")
    if types is None:
        first = get("max_window_layers")
        types = [
            "sliding_attention" if window is not None and i >= first else "full_attention"
            for i in range(layers)
        ]
    if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
        raise ValueError(
            f"config.json: layer_types must list 'full_attention' or 'sliding_attention' for "
            f"each of the {layers} layers, got {types!r}."
        )
    windows = {window if t == "sliding_attention" else None for t in types}
    if len(windows) > 1:
        raise ValueError(
            "config.json: use_sliding_window, max_window_layers and layer_types give a sliding "
            f"window on some layers only ({types}); the decoder needs one attention for all."
        )
    return windows.pop()
