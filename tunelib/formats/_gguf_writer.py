"""The decoder saved as a GGUF file (llama.cpp's format): the metadata `read_gguf` and llama.cpp
read back into the same config, the tensors under GGUF names in F32, F16, BF16 or Q8_0, and
tokenizer metadata written with the value types llama.cpp expects."""

import math
import os
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from flax import nnx
from jaxtyping import PyTree

from tunelib.formats._gguf_layout import (
    CONFIG_KEYS,
    GGUF_ARCHITECTURES,
    GLOBAL_TENSORS,
    LAYER_TENSORS,
)
from tunelib.formats._hf_checkpoint import checked_config, tensor_order, tensors_to_write
from tunelib.formats._hf_config import config_to_hf
from tunelib.models import DecoderConfig

# The tensor types `save_gguf` writes its 2-D weights in, with llama.cpp's `general.file_type`
# (gguf.LlamaFileType) of a file so written.
_FILE_TYPES: dict[str, int] = {"F32": 0, "F16": 1, "Q8_0": 7, "BF16": 32}
# The GGUF architecture of each Hugging Face `model_type` (the inverse of `read_gguf`'s;
# llama.cpp writes Mistral as `llama`).
_ARCHITECTURE_OF: dict[str, str] = {
    **{model_type: arch for arch, model_type in GGUF_ARCHITECTURES.items()},
    "mistral": "llama",
}
# The `{arch}.<key>` of each config.json field (the inverse of `read_gguf`'s), and the keys
# llama.cpp reads as float32 (the others are uint32).
_KEY_OF: dict[str, str] = {field: key for key, field in CONFIG_KEYS.items()}
_FLOAT_KEYS = ("attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor")
# GGUF tensor names of the Hugging Face modules (the inverse of `read_gguf`'s).
_LAYER_PART: dict[str, str] = {module: part for part, module in LAYER_TENSORS.items()}
_GLOBAL_PART: dict[str, str] = {module: part for part, module in GLOBAL_TENSORS.items()}
# The token ids of config.json and their tokenizer keys.
_TOKEN_ID_KEYS: dict[str, str] = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}
# GGUF value types of the tokenizer keys that llama.cpp reads (`gguf.Keys.Tokenizer`) other
# than strings, ids (`*_token_id`, uint32) and flags (below, bool).
_ARRAY_KEYS: dict[str, str] = {
    "tokenizer.ggml.tokens": "STRING",
    "tokenizer.ggml.merges": "STRING",
    "tokenizer.ggml.token_type": "INT32",
    "tokenizer.ggml.scores": "FLOAT32",
    "tokenizer.ggml.precompiled_charsmap": "UINT8",
    "tokenizer.chat_templates": "STRING",
}
_UINT32_KEYS = ("tokenizer.ggml.token_type_count",)
_BOOL_KEYS = (
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_eos_token",
    "tokenizer.ggml.add_sep_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.ggml.remove_extra_whitespaces",
)
_UNUSED = 5  # gguf.TokenType.UNUSED
_RANGES = {"UINT8": (0, 2**8), "INT32": (-(2**31), 2**31), "UINT32": (0, 2**32)}


class _Field(NamedTuple):
    """One key-value field: its GGUF value type (and that of an array's items) by name."""

    key: str
    value: Any
    type_name: str
    item_type_name: str | None = None


class _Tensor(NamedTuple):
    """One tensor to write: its GGUF name and type, HF shape, and how to make it in float32."""

    gguf_name: str
    type_name: str
    shape: tuple[int, ...]
    fetch: Callable[[], np.ndarray]  # float32, Hugging Face's layout, llama.cpp's row order


def save_gguf(
    path: str | os.PathLike,
    graphdef: nnx.GraphDef,
    params: PyTree,
    *,
    model_type: str | None = None,
    hf_config: Mapping[str, Any] | None = None,
    dtype: str = "F16",
    tokenizer_metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Save the decoder as a GGUF file (Llama, Qwen2 or Qwen3) that llama.cpp, `read_gguf` and
    `transformers`' GGUF loader read.

    The metadata are the inverse of `read_gguf`'s: `general.architecture`, `general.name`
    (the file's stem), `general.file_type`, and `{arch}.block_count`, `context_length`,
    `embedding_length`, `feed_forward_length`, `attention.head_count`,
    `attention.head_count_kv`, `attention.key_length` and `value_length`,
    `rope.dimension_count`, `rope.freq_base`, `attention.layer_norm_rms_epsilon` and
    `vocab_size`, with linear RoPE scaling as `rope.scaling.type` and `rope.scaling.factor`.
    Integers are uint32 and floats float32, the types llama.cpp reads (so `rms_norm_eps` and
    `rope_theta` come back rounded to float32). The token ids of `hf_config` become
    `tokenizer.ggml.bos_token_id` / `eos_token_id` / `padding_token_id`. A config that GGUF
    cannot express is an error that names the field: a sliding window, Llama 3 RoPE scaling
    (llama.cpp stores it as a `rope_freqs` tensor, which `read_gguf` does not read), or
    biases and norms the family lacks.

    Tensors are written under GGUF names (`blk.3.attn_q.weight` for
    `model.layers.3.self_attn.q_proj.weight`) in Hugging Face's `[out, in]` layout, with
    Llama's query and key rows (weights and biases) in llama.cpp's order (each head's two
    rotary halves interleaved), and `output.weight` only when the embeddings are not tied.
    Every 2-D weight (the embedding and `output.weight` too) is stored as `dtype`; 1-D tensors
    (norm scales, biases) stay F32. Q8_0 quantises blocks of 32 consecutive values of a row
    (`gguf.quants.quantize`, bit for bit llama.cpp's reference), so a matrix whose rows are
    not a multiple of 32 long is written in F16 instead, as llama.cpp's converter does.

    The tensors are made one at a time: each is fetched to the host, cast to float32,
    transposed, encoded and written before the next, so the memory used beyond `params`
    themselves is a few copies of the largest tensor (the embedding or `output.weight`) in
    float32, never a second copy of the model. The file is written beside `path` under a
    temporary name and renamed to `path` only once complete.

    Args:
      path: the `.gguf` file to write; it must not exist unless `overwrite`.
      graphdef: the `nnx.GraphDef` of a `tunelib.models.Decoder`.
      params: its parameters, an `nnx.State` or a pure dict, on any devices of this process.
        Merge LoRA adapters first.
      model_type: "llama", "qwen2" or "qwen3" ("mistral" is written as "llama", as llama.cpp
        writes it, and needs no sliding window); None means `hf_config`'s.
      hf_config: the `config.json` the model was loaded from (`HFCheckpoint.hf_config`), for
        its `model_type` and token ids; architectural fields come from the model's config.
      dtype: the type of the 2-D weights: "F32", "F16", "BF16" or "Q8_0".
      tokenizer_metadata: `tokenizer.*` keys written as given (`tokenizer.ggml.tokens`,
        `merges`, `token_type`, `scores`, ids, `add_bos_token`, `tokenizer.chat_template`,
        ...), each with the value type llama.cpp reads: string lists, int32 token types,
        float32 scores, uint32 ids, bool flags, strings. A vocabulary shorter than
        `vocab_size` is padded as llama.cpp's converter pads it (`[PAD<id>]` tokens of type
        UNUSED), since llama.cpp needs one token per embedding row.
      overwrite: replace an existing file (only once the new one is complete).

    Returns:
      The file.

    Raises:
      FileExistsError: if `path` exists and not `overwrite`, or is a directory.
      TypeError: if `graphdef` is not a `tunelib.models.Decoder`'s.
      ValueError: naming the field, key or argument, for a config GGUF cannot express, an
        unknown `dtype` or `model_type`, params that are not `graphdef`'s, or tokenizer
        metadata of the wrong type, size or disagreeing with `hf_config`'s token ids.

    Examples:
      >>> import tempfile
      >>> from flax import nnx
      >>> from tunelib.formats import read_gguf, save_gguf
      >>> from tunelib.models import Decoder, DecoderConfig
      >>> config = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
      ...                        num_hidden_layers=2, num_attention_heads=4,
      ...                        num_key_value_heads=2, tie_word_embeddings=True)
      >>> graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
      >>> path = save_gguf(tempfile.mkdtemp() + "/tiny.gguf", graphdef, params,
      ...                  model_type="llama", dtype="Q8_0")
      >>> model = read_gguf(path)
      >>> model.hf_config["num_key_value_heads"], model.hf_config["tie_word_embeddings"]
      (2, True)
      >>> for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.0.attn_norm.weight"):
      ...     tensor = next(t for t in model.tensors.values() if t.gguf_name == name)
      ...     print(name, tensor.type_name, tensor.shape)
      token_embd.weight Q8_0 (64, 32)
      blk.0.attn_q.weight Q8_0 (32, 32)
      blk.0.attn_norm.weight F32 (32,)
    """
    path = Path(path)
    if dtype not in _FILE_TYPES:
        raise ValueError(f"dtype must be one of {tuple(_FILE_TYPES)}, got {dtype!r}.")
    if path.is_dir():
        raise FileExistsError(f"{path} is a directory; give the path of a .gguf file.")
    if path.exists() and not overwrite:
        raise FileExistsError(f"{path} exists; pass overwrite=True to replace it.")
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    config = checked_config(graphdef, params)
    model_type = model_type or (hf_config or {}).get("model_type")
    if model_type not in _ARCHITECTURE_OF:
        raise ValueError(
            f"model_type must be one of {tuple(_ARCHITECTURE_OF)} (or hf_config's), got "
            f"{model_type!r}."
        )
    arch = _ARCHITECTURE_OF[model_type]
    hf = config_to_hf(config, model_type=model_type, base=hf_config)
    fields = [
        _Field("general.name", path.stem, "STRING"),
        _Field("general.file_type", _FILE_TYPES[dtype], "UINT32"),
        _Field("general.quantization_version", 2, "UINT32"),  # gguf.GGML_QUANT_VERSION
        *_architecture_fields(config, hf, arch),
        *_tokenizer_fields(tokenizer_metadata or {}, hf, config.vocab_size),
    ]
    tensors = list(_tensors(params, config, dtype, permute=arch == "llama"))
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.partial"
    try:
        _write(partial, arch, fields, tensors)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)
    return path


def _architecture_fields(
    config: DecoderConfig, hf: Mapping[str, Any], arch: str
) -> Iterator[_Field]:
    """The `{arch}.*` metadata of `hf` (config.json), or a ValueError naming a field that GGUF
    cannot express."""
    if config.sliding_window is not None:
        raise ValueError(
            f"sliding_window={config.sliding_window} cannot be saved: GGUF's {arch} metadata "
            "has no sliding window (llama.cpp would attend to every token)."
        )
    scaling = config.rope_scaling
    if scaling is not None and scaling["rope_type"] != "linear":
        raise ValueError(
            f"rope_scaling of type {scaling['rope_type']!r} cannot be saved: GGUF stores it as "
            "a rope_freqs tensor, which read_gguf does not read; only linear scaling is written."
        )
    values = {key: hf[field] for field, key in _KEY_OF.items()}
    values["rope.dimension_count"] = values["attention.value_length"] = config.head_dim
    if scaling is not None:
        values["rope.scaling.type"] = "linear"
        values["rope.scaling.factor"] = scaling["factor"]
    for key, value in values.items():
        if key in _FLOAT_KEYS:
            yield _Field(f"{arch}.{key}", float(value), "FLOAT32")
        elif isinstance(value, str):
            yield _Field(f"{arch}.{key}", value, "STRING")
        else:
            yield _Field(f"{arch}.{key}", int(value), "UINT32")


def _tokenizer_fields(
    metadata: Mapping[str, Any], hf: Mapping[str, Any], vocab_size: int
) -> Iterator[_Field]:
    """`metadata` with GGUF value types (its vocabulary padded to `vocab_size`), after `hf`'s
    token ids that it does not give."""
    metadata = _padded(metadata, vocab_size)
    for field, key in _TOKEN_ID_KEYS.items():
        token_id = hf.get(field)
        if token_id is None:
            continue
        if key in metadata:
            ids = token_id if isinstance(token_id, list) else [token_id]
            if metadata[key] not in ids:
                raise ValueError(
                    f"tokenizer_metadata[{key!r}] = {metadata[key]!r} disagrees with "
                    f"hf_config's {field} {token_id!r}."
                )
        elif isinstance(token_id, list):
            raise ValueError(
                f"hf_config's {field} is a list, {token_id!r}, but GGUF holds one id: give "
                f"tokenizer_metadata[{key!r}]."
            )
        else:
            yield _typed(key, token_id, "UINT32")
    for key, value in metadata.items():
        if not isinstance(key, str) or not key.startswith("tokenizer."):
            raise ValueError(
                f"tokenizer_metadata key {key!r} is not a tokenizer key (tokenizer.ggml.* or "
                "tokenizer.chat_template)."
            )
        if key in _ARRAY_KEYS:
            yield _typed_array(key, value, _ARRAY_KEYS[key])
        elif key.endswith("_token_id") or key in _UINT32_KEYS:
            yield _typed(key, value, "UINT32")
        elif key in _BOOL_KEYS:
            yield _typed(key, value, "BOOL")
        elif isinstance(value, str):
            yield _Field(key, value, "STRING")
        else:
            raise ValueError(
                f"tokenizer_metadata[{key!r}] is a {type(value).__name__}; keys other than "
                "llama.cpp's known tokenizer keys must be strings."
            )


def _padded(metadata: Mapping[str, Any], vocab_size: int) -> Mapping[str, Any]:
    """`metadata` with one token per embedding row, as llama.cpp needs: a shorter vocabulary
    padded as llama.cpp's converter pads it (`[PAD<id>]` tokens of type UNUSED, score -1000)."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, Sequence | np.ndarray) or isinstance(tokens, str):
        return metadata  # none, or not a list (which `_typed_array` names)
    if len(tokens) > vocab_size:
        raise ValueError(
            f"tokenizer_metadata['tokenizer.ggml.tokens'] lists {len(tokens)} tokens, more than "
            f"the model's vocab_size, {vocab_size}: llama.cpp needs one token per embedding row."
        )
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        entries = metadata.get(key)
        if isinstance(entries, Sequence | np.ndarray) and len(entries) != len(tokens):
            raise ValueError(
                f"tokenizer_metadata[{key!r}] has {len(entries)} entries, "
                f"tokenizer.ggml.tokens {len(tokens)}."
            )
    pad = range(len(tokens), vocab_size)
    if not pad:
        return metadata
    padding = {
        "tokenizer.ggml.tokens": [f"[PAD{i}]" for i in pad],
        "tokenizer.ggml.token_type": [_UNUSED] * len(pad),
        "tokenizer.ggml.scores": [-1000.0] * len(pad),
    }
    return {
        **metadata,
        **{key: [*metadata[key], *extra] for key, extra in padding.items() if key in metadata},
    }


def _typed(key: str, value: Any, type_name: str) -> _Field:
    """A scalar field, its value checked against its GGUF type."""
    if type_name == "BOOL":
        if not isinstance(value, bool | np.bool_):
            raise ValueError(f"tokenizer_metadata[{key!r}] must be a bool, got {value!r}.")
        return _Field(key, bool(value), type_name)
    low, high = _RANGES[type_name]
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise ValueError(f"{key} must be an integer, got {value!r}.")
    if not low <= value < high:
        raise ValueError(f"{key} = {value} is outside the range of {type_name} [{low}, {high}).")
    return _Field(key, int(value), type_name)


def _typed_array(key: str, value: Any, item_type: str) -> _Field:
    """An array field, its items checked against their GGUF type."""
    where = f"tokenizer_metadata[{key!r}]"
    if item_type == "UINT8" and isinstance(value, bytes | bytearray):
        value = list(value)
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | np.ndarray):
        raise ValueError(f"{where} must be a list, got {type(value).__name__}.")
    if len(value) == 0:
        raise ValueError(f"{where} is empty; GGUF arrays cannot be (leave the key out).")
    if item_type == "STRING":
        bad = next((x for x in value if not isinstance(x, str | bytes)), None)
        if bad is not None:
            raise ValueError(f"{where} must list strings, and holds {bad!r}.")
        return _Field(key, list(value), "ARRAY", item_type)
    array = np.asarray(value)
    kinds = "fiu" if item_type == "FLOAT32" else "iu"
    if array.ndim != 1 or array.dtype.kind not in kinds:
        raise ValueError(
            f"{where} must be a flat list of {'numbers' if kinds == 'fiu' else 'integers'}, got "
            f"an array of {array.dtype} and shape {array.shape}."
        )
    if item_type != "FLOAT32":
        low, high = _RANGES[item_type]
        if array.min() < low or array.max() >= high:
            raise ValueError(f"{where} has values outside the range of {item_type}.")
    return _Field(key, array.tolist(), "ARRAY", item_type)


def _tensor_type(dtype: str, shape: tuple[int, ...]) -> str:
    """The type a tensor is stored in: 1-D ones in F32, Q8_0 rows of a length that is not a
    multiple of its block size (32) in F16, as llama.cpp's converter does."""
    import gguf

    if len(shape) < 2:
        return "F32"
    block_size, _ = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[dtype]]
    return dtype if shape[-1] % block_size == 0 else "F16"


def _permute(x: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's row order of Llama's query / key projections, each head's two rotary halves
    interleaved (`[h, 2, d/2] -> [h, d/2, 2]` over the rows); `_gguf._unpermute` undoes it."""
    rows = x.shape[0]
    return x.reshape(heads, 2, rows // heads // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _gguf_name(hf_name: str) -> str:
    module, _, suffix = hf_name.rpartition(".")
    if module.startswith("model.layers."):
        _, _, layer, part = module.split(".", 3)
        return f"blk.{layer}.{_LAYER_PART[part]}.{suffix}"
    return f"{_GLOBAL_PART[module]}.{suffix}"


def _tensors(params: PyTree, config: DecoderConfig, dtype: str, *, permute: bool):
    """The tensors to write, in Hugging Face's order, each made on demand in float32."""
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    in_float32 = tensors_to_write(params, config, np.dtype(np.float32))
    for t in sorted(in_float32, key=lambda t: tensor_order(t.name)):
        name = _gguf_name(t.name)
        part = name.split(".")[-2]
        if permute and part in heads:

            def fetch(t=t, part=part):
                return _permute(t.fetch(), heads[part])
        else:
            fetch = t.fetch
        yield _Tensor(name, _tensor_type(dtype, t.shape), t.shape, fetch)


def _write(path: Path, arch: str, fields: Sequence[_Field], tensors: Sequence[_Tensor]) -> None:
    """Write the GGUF file: header, key-value fields, tensor infos, then each tensor's data,
    made and encoded only when its turn comes."""
    import gguf

    value_type = gguf.GGUFValueType
    writer = gguf.GGUFWriter(path, arch)
    try:
        for f in fields:
            item_type = None if f.item_type_name is None else value_type[f.item_type_name]
            writer.add_key_value(f.key, f.value, value_type[f.type_name], item_type)
        for t in tensors:
            qtype = gguf.GGMLQuantizationType[t.type_name]
            byte_shape = gguf.quant_shape_to_byte_shape(t.shape, qtype)
            nbytes = math.prod(byte_shape)
            writer.add_tensor_info(t.gguf_name, byte_shape, np.dtype(np.uint8), nbytes, qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in tensors:
            qtype = gguf.GGMLQuantizationType[t.type_name]
            writer.write_tensor_data(gguf.quants.quantize(t.fetch(), qtype))
        writer.flush()
        for handle in writer.fout or ():
            os.fsync(handle.fileno())
    finally:
        writer.close()


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
