"""The `vision_config` of a Hugging Face Gemma 4 checkpoint and the names of its vision weights."""

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from tunelib.models import VisionConfig

# transformers' `Gemma4VisionConfig` fields read into the `VisionConfig` field of the same
# name (its other fields: `rope_theta`, from `rope_parameters`, and the dtypes).
VISION_READ: tuple[str, ...] = tuple(
    f.name
    for f in dataclasses.fields(VisionConfig)
    if f.name not in ("rope_theta", "dtype", "param_dtype")
)
# Checked (a value the encoder cannot reproduce is refused) or, like transformers, not read:
# `attention_bias` (its projections have no bias whatever it says) and
# `max_position_embeddings` (positions come from the patch grid).
VISION_CHECKED: tuple[str, ...] = (
    "rope_parameters",
    "attention_dropout",
    "attention_bias",
    "max_position_embeddings",
)
# The keys every transformers config carries, none of which changes the encoder's outputs.
GENERIC_FIELDS = frozenset(
    {
        "model_type",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "architectures",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "id2label",
        "label2id",
        "problem_type",
        "_name_or_path",
        "tie_word_embeddings",
        "_attn_implementation_autoset",
    }
)
# transformers' defaults are `VisionConfig`'s.
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(VisionConfig)}
PREFIX = "model.vision_tower."
EMBEDDER_PREFIX = "model.embed_vision."


def vision_config_from_hf(
    hf: Mapping[str, Any], *, dtype: str = "float32", param_dtype: str = "float32"
) -> VisionConfig:
    """The `VisionConfig` of a Gemma 4 `vision_config` dict; a `ValueError` naming a field
    whose value the encoder cannot reproduce (a RoPE other than axial, dropout)."""
    if not isinstance(hf, Mapping):
        raise TypeError(f"vision_config must be a dict, got {type(hf).__name__}.")
    rope = hf.get("rope_parameters") or {"rope_type": "axial", "rope_theta": 100.0}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(
            f"config.json: vision_config.rope_parameters.rope_type is {rope['rope_type']!r}; "
            "Gemma 4's vision encoder supports only 'axial'."
        )
    if hf.get("attention_dropout") not in (None, 0, 0.0):
        raise ValueError(
            f"config.json: vision_config.attention_dropout is {hf['attention_dropout']!r}; "
            "the encoder has no dropout, so only 0 is supported."
        )
    fields = {name: hf.get(name, _DEFAULTS[name]) for name in VISION_READ}
    return VisionConfig(
        **fields,
        rope_theta=rope.get("rope_theta", 100.0),
        dtype=dtype,
        param_dtype=param_dtype,
    )


def vision_config_to_hf(config: VisionConfig) -> dict[str, Any]:
    """The `vision_config` dict of a `VisionConfig`, as transformers writes it."""
    return {
        "model_type": "gemma4_vision",
        **{name: getattr(config, name) for name in VISION_READ},
        "rope_parameters": {"rope_type": "axial", "rope_theta": config.rope_theta},
        "attention_dropout": 0.0,
        "attention_bias": False,
    }


def unknown_vision_fields(hf: Mapping[str, Any]) -> list[str]:
    """The keys of a `vision_config` dict that are neither read, checked nor generic."""
    known = {*VISION_READ, *VISION_CHECKED, *GENERIC_FIELDS}
    return sorted(set(hf) - known)


def vision_hf_name(path: tuple[str | int, ...]) -> tuple[str, bool]:
    """The Hugging Face tensor name of a `VisionEncoder` (under `vision_tower`) or
    `MultimodalEmbedder` (under `embed_vision`) parameter path, and whether it is a kernel
    (stored transposed there)."""
    head, *rest = (str(p) for p in path)
    *modules, name = rest
    if head == "vision_tower":
        prefix = PREFIX
        if modules and modules[0] == "layers":
            modules = ["encoder", *modules]
    elif head == "embed_vision":
        prefix = EMBEDDER_PREFIX
    else:
        raise ValueError(f"{'/'.join(map(str, path))} is not a vision parameter.")
    kernel = name == "kernel"
    leaf = "weight" if name in ("kernel", "scale") else name
    return prefix + ".".join([*modules, leaf]), kernel


def to_hf_tensor(value: np.ndarray, kernel: bool) -> np.ndarray:
    """A parameter as Hugging Face stores it (`[out, in]` for a kernel)."""
    return np.ascontiguousarray(np.swapaxes(value, -1, -2)) if kernel else np.asarray(value)
