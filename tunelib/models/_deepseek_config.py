"""The checks of `DecoderConfig`'s DeepSeek-V3 fields (multi-head latent attention, sigmoid
routing) and of the positive numbers every field check uses."""

import math
from typing import Any

SCORING_FUNCS: tuple[str, ...] = ("softmax", "sigmoid")


def check_positive_int(value: Any, name: str) -> None:
    """A `TypeError` unless `value` is an int, a `ValueError` unless it is > 0, naming it."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}.")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}.")


def check_positive_float(value: Any, name: str) -> None:
    """A `TypeError` unless `value` is a number, a `ValueError` unless finite and > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number, got {value!r}.")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}.")


def check_mla(config: Any) -> None:
    """Raise naming the field for an invalid multi-head latent attention setting (or one set
    without `kv_lora_rank`)."""
    mla = ("q_lora_rank", "qk_nope_head_dim", "v_head_dim", "rope_interleave")
    if config.kv_lora_rank is None:
        for name, unset in zip(mla, (None, 0, None, False), strict=True):
            if getattr(config, name) != unset:
                raise ValueError(
                    f"{name}={getattr(config, name)!r} belongs to multi-head latent attention "
                    f"(DeepSeek-V3), which needs kv_lora_rank; it is None here."
                )
        return
    for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        check_positive_int(getattr(config, name), name)
    if config.q_lora_rank is not None:
        check_positive_int(config.q_lora_rank, "q_lora_rank")
    if config.num_key_value_heads != config.num_attention_heads:
        raise ValueError(
            "multi-head latent attention (kv_lora_rank) needs num_key_value_heads == "
            f"num_attention_heads, got {config.num_key_value_heads} and "
            f"{config.num_attention_heads}."
        )
    ordinary = {
        "sliding_window": None,
        "use_qk_norm": False,
        "attention_sinks": False,
        "value_norm": False,
        "attention_k_eq_v": False,
        "num_kv_shared_layers": 0,
        "global_head_dim": None,
        "num_global_key_value_heads": None,
        "query_pre_attn_scalar": None,
        "attn_logit_softcapping": None,
        "o_proj_bias": config.attention_bias,
    }
    for name, value in ordinary.items():
        if getattr(config, name) != value:
            raise ValueError(
                f"multi-head latent attention (kv_lora_rank) does not support "
                f"{name}={getattr(config, name)!r} (it needs {name}={value!r})."
            )


def check_sigmoid_routing(config: Any) -> None:
    """Raise naming the field for an invalid `scoring_func` or DeepSeek-V3 routing setting
    (or one set with softmax routing)."""
    if config.scoring_func not in SCORING_FUNCS:
        raise ValueError(
            f"scoring_func must be one of {SCORING_FUNCS}, got {config.scoring_func!r}."
        )
    for name in ("n_group", "topk_group"):
        check_positive_int(getattr(config, name), name)
    if isinstance(config.n_shared_experts, bool) or not isinstance(config.n_shared_experts, int):
        raise TypeError(f"n_shared_experts must be an int, got {config.n_shared_experts!r}.")
    if config.n_shared_experts < 0:
        raise ValueError(f"n_shared_experts must be >= 0, got {config.n_shared_experts}.")
    check_positive_float(config.routed_scaling_factor, "routed_scaling_factor")
    if config.scoring_func == "softmax":
        unset = {"n_shared_experts": 0, "n_group": 1, "topk_group": 1}
        unset["routed_scaling_factor"] = 1.0
        for name, value in unset.items():
            if getattr(config, name) != value:
                raise ValueError(
                    f"{name}={getattr(config, name)!r} belongs to DeepSeek-V3's routing, "
                    "which needs scoring_func='sigmoid'; it is 'softmax' here."
                )
        return
    if not config.num_experts or config.parallel_moe or config.biased_experts:
        raise ValueError(
            "scoring_func='sigmoid' needs num_experts > 0, parallel_moe=False and "
            "biased_experts=False."
        )
    e, groups = config.num_experts, config.n_group
    if e % groups or e // groups < 2:
        raise ValueError(
            f"n_group ({groups}) must divide num_experts ({e}) into groups of at least 2 "
            "experts (a group's score is the sum of its two best)."
        )
    if config.topk_group > groups:
        raise ValueError(f"topk_group ({config.topk_group}) must be <= n_group ({groups}).")
    if config.num_experts_per_tok > config.topk_group * (e // groups):
        raise ValueError(
            f"num_experts_per_tok ({config.num_experts_per_tok}) must be <= the experts of "
            f"the topk_group={config.topk_group} groups chosen ({config.topk_group * e // groups})."
        )
