"""The `vision_config` of a Hugging Face Qwen3.5 checkpoint and the names of its vision weights."""

from collections.abc import Mapping
from typing import Any

import numpy as np

from tunelib.formats._hf_vision_config import VisionConfigFields
from tunelib.models import QwenVisionConfig

# transformers' `Qwen3_5VisionConfig`: every field read by name or from `rope_parameters`.
QWEN_VISION = VisionConfigFields(
    family="Qwen3.5", model_type="qwen3_5_vision", config_class=QwenVisionConfig
)
QWEN_VISION_PREFIX = "model.visual."
# The patch embedding: transformers' `Conv3d` weight `[C, in, T, p, p]`, ours `[in T p p, C]`.
_PATCH_KERNEL = "model.visual.patch_embed.proj.weight"


def qwen_vision_config_from_hf(
    hf: Mapping[str, Any], *, dtype: str = "float32", param_dtype: str = "float32"
) -> QwenVisionConfig:
    """The `QwenVisionConfig` of a Qwen3.5 `vision_config` dict; a `ValueError` naming a
    field the encoder cannot reproduce (a RoPE other than axial, rectangular patches)."""
    fields = QWEN_VISION.from_hf(hf)
    for name in ("patch_size", "temporal_patch_size"):
        value = fields[name]
        if isinstance(value, list | tuple):
            if len(set(value)) != 1:
                raise ValueError(
                    f"config.json: vision_config.{name} is {value!r}; only square patches "
                    "(one size) are supported."
                )
            fields[name] = value[0]
    return QwenVisionConfig(**fields, dtype=dtype, param_dtype=param_dtype)


def qwen_vision_hf_name(path: tuple[str | int, ...]) -> tuple[str, bool]:
    """The Hugging Face tensor name of a `QwenVisionEncoder` parameter path (under
    `visual`), and whether it is a kernel (stored `[out, in]` there)."""
    head, *modules, name = (str(p) for p in path)
    if head != "visual":
        raise ValueError(f"{'/'.join(map(str, path))} is not a vision parameter.")
    if modules == ["patch_embed"]:
        modules = ["patch_embed", "proj"]
    if name == "pos_embed":
        return QWEN_VISION_PREFIX + "pos_embed.weight", False
    leaf = {"kernel": "weight", "scale": "weight"}.get(name, name)
    return QWEN_VISION_PREFIX + ".".join([*modules, leaf]), name == "kernel"


def qwen_vision_from_hf(name: str, tensor: np.ndarray, kernel: bool) -> np.ndarray:
    """A Hugging Face vision tensor as our parameter holds it (kernels `[in, out]`)."""
    if name == _PATCH_KERNEL:
        tensor = tensor.reshape(tensor.shape[0], -1)
    return np.swapaxes(tensor, -1, -2) if kernel else tensor


def qwen_vision_hf_shape(
    name: str, shape: tuple[int, ...], kernel: bool, config: QwenVisionConfig
) -> tuple[int, ...]:
    """The shape of the Hugging Face tensor `name` of our parameter of `shape`."""
    if name == _PATCH_KERNEL:
        c = config
        return (c.hidden_size, c.in_channels, c.temporal_patch_size, c.patch_size, c.patch_size)
    return (*shape[:-2], shape[-1], shape[-2]) if kernel else tuple(shape)


def qwen_vision_to_hf(
    name: str, value: np.ndarray, kernel: bool, config: QwenVisionConfig
) -> np.ndarray:
    """Our vision parameter as the Hugging Face tensor `name` holds it."""
    value = np.swapaxes(value, -1, -2) if kernel else value
    return np.ascontiguousarray(
        value.reshape(qwen_vision_hf_shape(name, value.shape, False, config))
    )
