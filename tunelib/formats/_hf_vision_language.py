"""Hugging Face Gemma 4 and Qwen3.5 vision-language checkpoints
(`Gemma4ForConditionalGeneration`, `Qwen3_5ForConditionalGeneration`) into
`tunelib.models.VisionLanguageModel` and back."""

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import PyTree

from tunelib.formats._hf_checkpoint import (
    checked_config,
    load_tensors,
    tensor_order,
    tensors_to_write,
    write_checkpoint,
)
from tunelib.formats._hf_config import config_to_hf
from tunelib.formats._hf_gemma4_vision import (
    EMBEDDER_PREFIX,
    GEMMA4_VISION,
    PREFIX,
    to_hf_tensor,
    vision_config_from_hf,
    vision_config_to_hf,
    vision_hf_name,
)
from tunelib.formats._hf_qwen_vision import (
    QWEN_VISION,
    QWEN_VISION_PREFIX,
    qwen_vision_config_from_hf,
    qwen_vision_from_hf,
    qwen_vision_hf_name,
    qwen_vision_hf_shape,
    qwen_vision_to_hf,
)
from tunelib.formats._load_options import LoadOptions
from tunelib.formats._safetensors import FLOAT_DTYPES, TensorFiles, TensorToWrite
from tunelib.models import DecoderConfig, QwenVisionConfig, VisionConfig, VisionLanguageModel

_LANGUAGE = "model.language_model."
ARCHITECTURE = "Gemma4ForConditionalGeneration"
QWEN_ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
# transformers' default `mrope_section` when a Qwen3.5 `rope_parameters` has none.
QWEN_MROPE_SECTION = (11, 11, 10)


class _Family(NamedTuple):
    """How one family's vision weights are named and stored: its parts (attributes of the
    model), their tensor prefixes, the HF name of a parameter path (and whether it is a
    kernel), a tensor's conversion each way and the HF shape of a parameter's."""

    parts: tuple[str, ...]
    prefixes: tuple[str, ...]
    name_of: Callable[[tuple], tuple[str, bool]]
    from_hf: Callable[[str, np.ndarray, bool], np.ndarray]
    to_hf: Callable[[str, np.ndarray, bool, Any], np.ndarray]
    hf_shape: Callable[[str, tuple[int, ...], bool, Any], tuple[int, ...]]


def _swapped_shape(name, shape, kernel, config):
    return (*shape[:-2], shape[-1], shape[-2]) if kernel else tuple(shape)


_GEMMA4 = _Family(
    ("vision_tower", "embed_vision"),
    (PREFIX, EMBEDDER_PREFIX),
    vision_hf_name,
    lambda name, tensor, kernel: np.swapaxes(tensor, -1, -2) if kernel else tensor,
    lambda name, value, kernel, config: to_hf_tensor(value, kernel),
    _swapped_shape,
)
_QWEN = _Family(
    ("visual",), (QWEN_VISION_PREFIX,), qwen_vision_hf_name, qwen_vision_from_hf,
    qwen_vision_to_hf, qwen_vision_hf_shape,
)  # fmt: skip


class HFVisionLanguage(NamedTuple):
    """A Hugging Face Gemma 4 or Qwen3.5 vision-language checkpoint loaded into a
    `VisionLanguageModel`.

    Attributes:
      graphdef: the `nnx.GraphDef` of the `tunelib.models.VisionLanguageModel`.
      params: its parameters as a pure dict (`language_model`, and `vision_tower` and
        `embed_vision` for Gemma 4, `visual` for Qwen3.5); `nnx.merge(graphdef, params)` is
        the model.
      config: the language model's `DecoderConfig`.
      vision_config: the encoder's `VisionConfig` or `QwenVisionConfig`.
      hf_config: `config.json` as read, for its token ids and for saving.
    """

    graphdef: nnx.GraphDef
    params: PyTree[jax.Array]
    config: DecoderConfig
    vision_config: VisionConfig | QwenVisionConfig
    hf_config: dict[str, Any]


class _LanguageModelTensors:
    """The language model's tensors of a multimodal checkpoint under the names of a text
    checkpoint (`model.language_model.X` read as `model.X`), for the text loader."""

    def __init__(self, files: TensorFiles):
        self.files, self.directory = files, files.directory
        self._names = {
            "model." + name[len(_LANGUAGE) :]: name
            for name in files.names()
            if name.startswith(_LANGUAGE)
        }
        if "lm_head.weight" in files.names():
            self._names["lm_head.weight"] = "lm_head.weight"
        self.file_of = {ours: files.file_of[theirs] for ours, theirs in self._names.items()}

    def names(self) -> set[str]:
        return set(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.files.shape(self._names[name])

    def dtype_code(self, name: str) -> str:
        return self.files.dtype_code(self._names[name])

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        return self.files.read(self._names[name], index)


def load_hf_vision_language(
    directory: str | os.PathLike, options: LoadOptions | None = None, **keywords: Any
) -> HFVisionLanguage:
    """Load a Hugging Face Gemma 4 (`model_type` "gemma4") or Qwen3.5 ("qwen3_5")
    vision-language checkpoint.

    The language model (`text_config`, tensors `model.language_model.*` and `lm_head`) is
    read as `load_hf_checkpoint` reads a `gemma4_text` or `qwen3_5_text` checkpoint; Gemma
    4's vision encoder (`vision_config`, `model.vision_tower.*`) and multimodal embedder
    (`model.embed_vision.*`), or Qwen3.5's encoder and merger (`model.visual.*`), by their
    names in `docs/models.md`. Every field of `vision_config` is read or refused by name,
    as are Gemma 4's `use_bidirectional_attention` ("vision" and null are supported) and
    audio tower (not supported); Qwen3.5's language model takes transformers' default
    `mrope_section` (11, 11, 10) when its `rope_parameters` has none. Every tensor is
    accounted for: one missing, unexpected or of the wrong shape is an error naming it. The
    parameters are placed on the default device.

    Args:
      directory: the checkpoint directory (`config.json` and safetensors).
      options: how to load it (`LoadOptions`; None means its defaults): the dtypes are both
        models', `scan_layers` and `remat` the language model's; its placement must be the
        default one (no `mesh`, no `shardings`).
      **keywords: fields of `LoadOptions` by name, replacing those of `options`.

    Returns:
      An `HFVisionLanguage` `(graphdef, params, config, vision_config, hf_config)`.

    Raises:
      FileNotFoundError: without `config.json` or safetensors weights.
      ValueError: naming the field or tensor the model cannot reproduce or account for, or
        a `mesh` or `shardings` option.
      TypeError: for a keyword argument that is not a field of `LoadOptions`.
    """
    options = LoadOptions.from_arguments(options, **keywords)
    if options.mesh is not None or options.shardings is not None:
        raise ValueError(
            "load_hf_vision_language places the parameters on the default device; mesh and "
            "shardings must be None."
        )
    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.exists():
        raise FileNotFoundError(f"{directory} has no config.json.")
    hf = json.loads(config_path.read_text())
    qwen = hf.get("model_type") == "qwen3_5"
    text_hf, bidirectional = _qwen_text_config(hf) if qwen else _text_config(hf)
    vision_hf = hf.get("vision_config")
    if not isinstance(vision_hf, Mapping):
        raise ValueError("config.json: vision_config is missing; this is not a vision model.")
    unknown = (QWEN_VISION if qwen else GEMMA4_VISION).unknown(vision_hf)
    if unknown:
        raise ValueError(f"config.json: vision_config fields {unknown} are not supported.")
    read_vision = qwen_vision_config_from_hf if qwen else vision_config_from_hf
    vision = read_vision(vision_hf, dtype=options.dtype, param_dtype=options.param_dtype)
    family = _QWEN if qwen else _GEMMA4
    with TensorFiles(directory) as files:
        text = load_tensors(_LanguageModelTensors(files), text_hf, options)
        config = text.config
        if qwen and config.mrope_section is None:
            config = dataclasses.replace(config, mrope_section=QWEN_MROPE_SECTION)
        model = nnx.eval_shape(
            lambda: VisionLanguageModel(
                config,
                vision,
                image_token_id=hf["image_token_id"],
                pad_token_id=text_hf.get("pad_token_id") or 0,
                bidirectional=bidirectional,
                rngs=nnx.Rngs(0),
            )
        )
        graphdef, state = nnx.split(model)
        abstract = nnx.to_pure_dict(state)
        params = {"language_model": text.params}
        for part in family.parts:
            params[part] = _read_part(files, abstract[part], (part,), options.param_dtype, family)
        leftover = sorted(
            name
            for name in files.names()
            if not name.startswith((_LANGUAGE, *family.prefixes, "lm_head."))
        )
        if leftover:
            raise ValueError(
                f"the checkpoint in {directory} holds tensors the model does not have: "
                f"{leftover[:8]}."
            )
    return HFVisionLanguage(graphdef, params, config, vision, hf)


def _qwen_text_config(hf: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """The `qwen3_5_text` config.json of a Qwen3.5 vision-language model's language model
    (its image tokens attend causally)."""
    architectures = hf.get("architectures")
    if architectures is not None and list(architectures) != [QWEN_ARCHITECTURE]:
        raise ValueError(
            f"config.json: architectures must be [{QWEN_ARCHITECTURE!r}], got {architectures!r}."
        )
    text = dict(hf.get("text_config") or {})
    text.update(model_type="qwen3_5_text", tie_word_embeddings=hf.get("tie_word_embeddings", False))
    text.pop("architectures", None)
    return text, False


def _text_config(hf: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
    """The `gemma4_text` config.json of the language model and whether image tokens attend
    within their image (`use_bidirectional_attention`)."""
    if hf.get("model_type") != "gemma4":
        raise ValueError(f"config.json: model_type must be 'gemma4', got {hf.get('model_type')!r}.")
    architectures = hf.get("architectures")
    if architectures is not None and list(architectures) != [ARCHITECTURE]:
        raise ValueError(
            f"config.json: architectures must be [{ARCHITECTURE!r}], got {architectures!r}."
        )
    if hf.get("audio_config") is not None:
        raise ValueError("config.json: audio_config is set; the audio tower is not supported.")
    text = dict(hf.get("text_config") or {})
    mode = text.get("use_bidirectional_attention")
    if mode not in (None, "vision"):
        raise ValueError(
            f"config.json: text_config.use_bidirectional_attention is {mode!r}; only 'vision' "
            "(image tokens attend within their image) and null are supported."
        )
    text.update(
        model_type="gemma4_text",
        use_bidirectional_attention=None,
        tie_word_embeddings=hf.get("tie_word_embeddings", True),
    )
    text.pop("architectures", None)
    return text, mode == "vision"


def _read_part(
    files: TensorFiles, abstract: PyTree, path: tuple, param_dtype: str, family: _Family
) -> PyTree:
    """The parameters of `abstract` (a pure dict of shapes) read from their HF tensors."""
    out = {}
    for key, value in abstract.items():
        if isinstance(value, Mapping):
            out[key] = _read_part(files, value, (*path, key), param_dtype, family)
            continue
        name, kernel = family.name_of((*path, key))
        if name not in files.names():
            raise ValueError(f"the checkpoint in {files.directory} has no tensor {name!r}.")
        if files.dtype_code(name) not in FLOAT_DTYPES:
            raise ValueError(
                f"tensor {name!r} has dtype {files.dtype_code(name)}; only floats load."
            )
        tensor = files.read(name, tuple(slice(None) for _ in files.shape(name)))
        tensor = family.from_hf(name, tensor, kernel)
        if tensor.shape != value.shape:
            raise ValueError(
                f"tensor {name!r} has shape {list(files.shape(name))}, which does not match "
                f"the config's {list(value.shape)}{' (transposed)' if kernel else ''}."
            )
        out[key] = jnp.asarray(tensor, param_dtype)
    return out


def save_hf_vision_language(
    directory: str | os.PathLike,
    graphdef: nnx.GraphDef,
    params: PyTree,
    *,
    hf_config: Mapping[str, Any] | None = None,
    dtype: str | None = None,
    max_shard_size: int = 5 * 10**9,
    overwrite: bool = False,
    copy_files_from: str | os.PathLike | None = None,
) -> Path:
    """Save a `VisionLanguageModel` as a Gemma 4 or Qwen3.5 checkpoint that transformers
    loads (`Gemma4ForConditionalGeneration`, `Qwen3_5ForConditionalGeneration`).

    The language model's tensors are written as `save_hf_checkpoint` writes a
    `gemma4_text` or `qwen3_5_text` model, under `model.language_model.`; Gemma 4's encoder
    under `model.vision_tower.` and its embedder under `model.embed_vision.`, Qwen3.5's
    encoder and merger under `model.visual.` (kernels `[out, in]`, the patch embedding as
    a `Conv3d` weight). `config.json` has the `text_config`, the `vision_config` and the
    image token id; `hf_config` (the one loaded) keeps its other fields (the other token
    ids among them). Written whole or not at all, as `save_hf_checkpoint` writes.

    Args:
      directory: where the checkpoint goes; it must not exist unless `overwrite`.
      graphdef: the `nnx.GraphDef` of a `tunelib.models.VisionLanguageModel`.
      params: its parameters (an `nnx.State` or a pure dict) on this process.
      hf_config: the `config.json` the model was loaded from, or None.
      dtype: the dtype the weights are saved in; None means the language model's
        `param_dtype`.
      max_shard_size: the most bytes of tensors in one file.
      overwrite: replace an existing `directory`.
      copy_files_from: a directory whose tokenizer and template files are copied in.

    Returns:
      The checkpoint directory.
    """
    directory = Path(directory)
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    model = nnx.merge(graphdef, shapes)
    if not isinstance(model, VisionLanguageModel):
        raise TypeError("graphdef must be the nnx.GraphDef of a VisionLanguageModel.")
    language_graphdef, _ = nnx.split(model.language_model)
    config = checked_config(language_graphdef, params["language_model"])
    base = dict(hf_config or {})
    qwen = isinstance(model.vision_config, QwenVisionConfig)
    text_type = "qwen3_5_text" if qwen else "gemma4_text"
    text = config_to_hf(config, model_type=text_type, base=base.get("text_config"), dtype=dtype)
    text["pad_token_id"] = model.pad_token_id
    text.pop("architectures", None)
    if qwen:
        family = _QWEN
        vision = QWEN_VISION.to_hf(model.vision_config)
        hf = {**base, "model_type": "qwen3_5", "architectures": [QWEN_ARCHITECTURE]}
    else:
        family = _GEMMA4
        text["use_bidirectional_attention"] = "vision" if model.bidirectional else None
        vision = vision_config_to_hf(model.vision_config)
        hf = {**base, "model_type": "gemma4", "architectures": [ARCHITECTURE], "audio_config": None}
    hf.update(
        text_config=text,
        vision_config=vision,
        image_token_id=model.image_token_id,
        tie_word_embeddings=config.tie_word_embeddings,
        dtype=text["dtype"],
    )
    if max_shard_size < 1:
        raise ValueError(f"max_shard_size must be >= 1 byte, got {max_shard_size}.")
    if directory.exists() and not overwrite:
        raise FileExistsError(f"{directory} exists; pass overwrite=True to replace it.")
    target = np.dtype(jnp.dtype(text["dtype"]))
    tensors = [
        t._replace(name=_LANGUAGE + t.name[len("model.") :]) if t.name.startswith("model.") else t
        for t in tensors_to_write(params["language_model"], config, target)
    ]
    tensors.sort(key=lambda t: tensor_order(t.name))
    for part in family.parts:
        for keypath, leaf in jax.tree_util.tree_flatten_with_path(params[part])[0]:
            name, kernel = family.name_of((part, *(k.key for k in keypath)))
            hf_shape = family.hf_shape(name, tuple(np.shape(leaf)), kernel, model.vision_config)

            def fetch(leaf=leaf, name=name, kernel=kernel):
                value = np.asarray(jax.device_get(leaf))
                return family.to_hf(name, value, kernel, model.vision_config).astype(target)

            tensors.append(TensorToWrite(name, hf_shape, target, fetch))
    return write_checkpoint(
        directory, tensors, hf, max_shard_size=max_shard_size, copy_files_from=copy_files_from
    )
