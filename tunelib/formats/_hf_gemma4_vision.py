"""The `vision_config` of a Hugging Face Gemma 4 checkpoint and the names of its vision weights."""

from collections.abc import Mapping
from typing import Any

import numpy as np

from tunelib.formats._hf_vision_config import VisionConfigFields
from tunelib.models import VisionConfig

# transformers' `Gemma4VisionConfig`: `attention_dropout` is checked (only 0), and as in
# transformers `attention_bias` (its projections have no bias whatever it says) and
# `max_position_embeddings` (positions come from the patch grid) are not read.
GEMMA4_VISION = VisionConfigFields(
    family="Gemma 4",
    model_type="gemma4_vision",
    config_class=VisionConfig,
    checked=("attention_dropout", "attention_bias", "max_position_embeddings"),
)
PREFIX = "model.vision_tower."
EMBEDDER_PREFIX = "model.embed_vision."


def vision_config_from_hf(
    hf: Mapping[str, Any], *, dtype: str = "float32", param_dtype: str = "float32"
) -> VisionConfig:
    """The `VisionConfig` of a Gemma 4 `vision_config` dict; a `ValueError` naming a field
    whose value the encoder cannot reproduce (a RoPE other than axial, dropout)."""
    fields = GEMMA4_VISION.from_hf(hf)
    if hf.get("attention_dropout") not in (None, 0, 0.0):
        raise ValueError(
            f"config.json: vision_config.attention_dropout is {hf['attention_dropout']!r}; "
            "the encoder has no dropout, so only 0 is supported."
        )
    return VisionConfig(**fields, dtype=dtype, param_dtype=param_dtype)


def vision_config_to_hf(config: VisionConfig) -> dict[str, Any]:
    """The `vision_config` dict of a `VisionConfig`, as transformers writes it."""
    return {**GEMMA4_VISION.to_hf(config), "attention_dropout": 0.0, "attention_bias": False}


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
