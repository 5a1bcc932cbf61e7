"""The `vision_config` of a Hugging Face Qwen3.5 checkpoint and the names of its vision weights."""

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from tunelib.formats._hf_gemma4_vision import GENERIC_FIELDS
from tunelib.models import QwenVisionConfig

# transformers' `Qwen3_5VisionConfig` fields read into the `QwenVisionConfig` field of the
# same name (its other fields: `rope_theta`, from `rope_parameters`, and the dtypes).
QWEN_VISION_READ: tuple[str, ...] = tuple(
    f.name
    for f in dataclasses.fields(QwenVisionConfig)
    if f.name not in ("rope_theta", "dtype", "param_dtype")
)
# Checked: a RoPE other than axial is refused (`rope_theta` is read from it).
QWEN_VISION_CHECKED: tuple[str, ...] = ("rope_parameters",)
_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(QwenVisionConfig)}
QWEN_VISION_PREFIX = "model.visual."
# The patch embedding: transformers' `Conv3d` weight `[C, in, T, p, p]`, ours `[in T p p, C]`.
_PATCH_KERNEL = "model.visual.patch_embed.proj.weight"


def qwen_vision_config_from_hf(
    hf: Mapping[str, Any], *, dtype: str = "float32", param_dtype: str = "float32"
) -> QwenVisionConfig:
    """The `QwenVisionConfig` of a Qwen3.5 `vision_config` dict; a `ValueError` naming a
    field the encoder cannot reproduce (a RoPE other than axial, rectangular patches)."""
    if not isinstance(hf, Mapping):
        raise TypeError(f"vision_config must be a dict, got {type(hf).__name__}.")
    rope = hf.get("rope_parameters") or {"rope_type": "axial", "rope_theta": 10000.0}
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(
            f"config.json: vision_config.rope_parameters.rope_type is {rope['rope_type']!r}; "
            "Qwen3.5's vision encoder supports only 'axial'."
        )
    fields = {name: hf.get(name, _DEFAULTS[name]) for name in QWEN_VISION_READ}
    for name in ("patch_size", "temporal_patch_size"):
        value = fields[name]
        if isinstance(value, list | tuple):
            if len(set(value)) != 1:
                raise ValueError(
                    f"config.json: vision_config.{name} is {value!r}; only square patches "
                    "(one size) are supported."
                )
            fields[name] = value[0]
    return QwenVisionConfig(
        **fields,
        rope_theta=rope.get("rope_theta", 10000.0),
        dtype=dtype,
        param_dtype=param_dtype,
    )


def qwen_vision_config_to_hf(config: QwenVisionConfig) -> dict[str, Any]:
    """The `vision_config` dict of a `QwenVisionConfig`, as transformers writes it."""
    return {
        "model_type": "qwen3_5_vision",
        **{name: getattr(config, name) for name in QWEN_VISION_READ},
        "rope_parameters": {"rope_type": "axial", "rope_theta": config.rope_theta},
    }


def unknown_qwen_vision_fields(hf: Mapping[str, Any]) -> list[str]:
    """The keys of a `vision_config` dict that are neither read, checked nor generic."""
    return sorted(set(hf) - {*QWEN_VISION_READ, *QWEN_VISION_CHECKED, *GENERIC_FIELDS})


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
