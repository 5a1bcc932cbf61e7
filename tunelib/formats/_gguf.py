"""GGUF files (llama.cpp's format) read into Hugging Face terms: the metadata as a
`config.json`, the tensors dequantised under Hugging Face names and layouts, and a conversion
into a Hugging Face checkpoint folder that `load_hf_checkpoint` and every `--model DIR` read."""

import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tunelib.formats._gguf_file import GGUFFile, read_gguf_file
from tunelib.formats._gguf_layout import (
    CONFIG_KEYS,
    GGUF_ARCHITECTURES,
    GGUF_TENSOR_TYPES,
    GLOBAL_TENSORS,
    LAYER_TENSORS,
    check_gguf_file,
)
from tunelib.formats._gguf_tokenizer import gguf_tokenizer
from tunelib.formats._hf_checkpoint import HFCheckpoint, load_tensors, write_checkpoint
from tunelib.formats._hf_config import ARCHITECTURES
from tunelib.formats._load_options import LoadOptions
from tunelib.formats._safetensors import TensorToWrite

# Keys read and checked rather than copied.
_CHECKED_KEYS = ("rope.dimension_count", "attention.value_length", "rope.scaling.type")
_ROPE_SCALING_KEYS = ("rope.scaling.factor", "rope.scaling.original_context_length")


class GGUFTensor(NamedTuple):
    """One tensor of a GGUF file under its Hugging Face name (not yet dequantised)."""

    gguf_name: str
    hf_name: str
    type_name: str
    shape: tuple[int, ...]  # Hugging Face's (row-major, `[out, in]` for a projection)
    unpermute_heads: int | None  # llama.cpp's query / key row order, undone with this many heads


class GGUFModel(NamedTuple):
    """What `read_gguf` finds in a file.

    Attributes:
      path: the file.
      hf_config: the `config.json` of the equivalent Hugging Face checkpoint.
      metadata: every key-value field of the file (arrays as lists).
      tensors: the model's tensors by Hugging Face name, in file order.
    """

    path: Path
    hf_config: dict[str, Any]
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]


def _reader(path: Path) -> GGUFFile:
    """The metadata and tensors of `path` (`read_gguf_file`), one reading per version of the
    file: `read_gguf`, `load_gguf` and `tunelib.peft.gguf_base` each need them."""
    check_gguf_file(path)
    stat = path.stat()
    return _cached_reader(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    return read_gguf_file(path)


def _hf_config(path: Path, metadata: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: general.architecture {arch!r} is not supported; the supported ones are "
            f"{sorted(GGUF_ARCHITECTURES)}."
        )
    model_type = GGUF_ARCHITECTURES[arch]
    known = set(CONFIG_KEYS) | set(_CHECKED_KEYS) | set(_ROPE_SCALING_KEYS)
    for key in sorted(k for k in metadata if k.startswith(f"{arch}.")):
        if key.removeprefix(f"{arch}.") not in known:
            raise ValueError(f"{path}: metadata key {key!r} is not supported.")

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    config: dict[str, Any] = {"model_type": model_type}
    for key, field in CONFIG_KEYS.items():
        if get(key) is not None:
            config[field] = get(key)
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in metadata:
        config["vocab_size"] = len(metadata["tokenizer.ggml.tokens"])
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads"):  # fmt: skip
        if key not in config:
            raise ValueError(f"{path}: the metadata gives no {key} ({arch}.* keys).")
    heads = config["num_attention_heads"]
    config.setdefault("num_key_value_heads", heads)
    head_dim = config.get("head_dim", config["hidden_size"] // heads)
    config["head_dim"] = head_dim
    for key in ("rope.dimension_count", "attention.value_length"):
        if get(key) is not None and get(key) != head_dim:
            raise ValueError(
                f"{path}: {arch}.{key} = {get(key)} differs from the head size {head_dim}; "
                "partial rotary embeddings and value heads of another size are not supported."
            )
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none", "linear"):
        raise ValueError(f"{path}: {arch}.rope.scaling.type {scaling!r} is not supported.")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor")}
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    # Biases are config fields of Llama and Qwen3 (Qwen2 always has the q/k/v ones).
    if model_type in ("llama", "qwen3"):
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if model_type == "llama":
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
    for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"),
                      ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                      ("pad_token_id", "tokenizer.ggml.padding_token_id")):  # fmt: skip
        if name in metadata:
            config[key] = metadata[name]
    config["architectures"] = [ARCHITECTURES[model_type]]
    return config


def _hf_name(path: Path, gguf_name: str) -> str:
    module, _, suffix = gguf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        raise ValueError(f"{path}: tensor {gguf_name!r} is not a weight or a bias.")
    if module.startswith("blk."):
        _, layer, part = module.split(".", 2)
        if layer.isdigit() and part in LAYER_TENSORS:
            return f"model.layers.{layer}.{LAYER_TENSORS[part]}.{suffix}"
    elif module in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[module]}.{suffix}"
    raise ValueError(f"{path}: tensor {gguf_name!r} is not one the decoder has.")


def read_gguf(path: str | os.PathLike) -> GGUFModel:
    """The config and tensor list of a GGUF model file (Llama, Qwen2 or Qwen3), without
    dequantising anything.

    The metadata become the `config.json` fields of the equivalent Hugging Face checkpoint
    (`{arch}.block_count` is `num_hidden_layers`, `{arch}.rope.freq_base` is `rope_theta`, and
    so on; the token ids come from `tokenizer.ggml.*`). A key of the architecture that the
    decoder cannot honour, or does not know, is an error that names it, never ignored. The
    embeddings are tied when the file has no `output.weight`, as llama.cpp writes it.

    Args:
      path: the `.gguf` file.

    Returns:
      A `GGUFModel`: the file, its `hf_config`, all metadata and the tensors by Hugging Face
      name.

    Raises:
      FileNotFoundError: the file does not exist.
      ValueError: naming the file and the key, type or tensor, for a file that is not GGUF or
        is truncated, an unsupported architecture, metadata key or tensor type, or a tensor
        the decoder does not have.

    Examples:
      >>> import tempfile, gguf, numpy as np
      >>> from tunelib.formats import read_gguf
      >>> path = tempfile.mkdtemp() + "/tiny.gguf"
      >>> w = gguf.GGUFWriter(path, "llama")
      >>> for key, value in {"block_count": 1, "embedding_length": 8, "feed_forward_length": 16,
      ...                    "attention.head_count": 2, "vocab_size": 10}.items():
      ...     w.add_uint32(f"llama.{key}", value)
      >>> w.add_tensor("token_embd.weight", np.ones((10, 8), np.float32))
      >>> w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file()
      >>> w.close()
      >>> model = read_gguf(path)
      >>> model.hf_config["num_hidden_layers"], model.hf_config["tie_word_embeddings"]
      (1, True)
      >>> model.tensors["model.embed_tokens.weight"].shape
      (10, 8)
    """
    path = Path(path)
    reader = _reader(path)
    metadata = reader.metadata
    names = {t.name for t in reader.tensors}
    hf_config = _hf_config(path, metadata, names)
    heads, kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
    unpermute = hf_config["model_type"] == "llama"
    tensors: dict[str, GGUFTensor] = {}
    for t in reader.tensors:
        type_name = t.tensor_type.name
        if type_name not in GGUF_TENSOR_TYPES:
            raise ValueError(
                f"{path}: tensor {t.name!r} has type {type_name}, which is not supported; the "
                f"supported types are {', '.join(GGUF_TENSOR_TYPES)}."
            )
        hf_name = _hf_name(path, t.name)
        part = t.name.split(".")[-2]
        heads_of = {"attn_q": heads, "attn_k": kv_heads}.get(part) if unpermute else None
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[hf_name] = GGUFTensor(t.name, hf_name, type_name, shape, heads_of)
    return GGUFModel(path, hf_config, metadata, tensors)


def _unpermute(x: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's conversion of query / key rows, which interleaves the two rotary halves
    of each head (`[h, 2, d/2] -> [h, d/2, 2]` over the rows)."""
    rows = x.shape[0]
    return x.reshape(heads, rows // heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _dequantised(raw, tensor: GGUFTensor, dtype) -> np.ndarray:
    """One tensor of the file in float32 with the `gguf` package, llama.cpp's query / key row
    order undone, then cast to `dtype`."""
    import gguf

    values = gguf.quants.dequantize(raw.data, raw.tensor_type).astype(np.float32, copy=False)
    values = values.reshape(tensor.shape)
    if tensor.unpermute_heads is not None:
        values = _unpermute(values, tensor.unpermute_heads)
    return values.astype(dtype)


def gguf_tensors(model: GGUFModel, dtype: str = "float32") -> Iterator[tuple[str, np.ndarray]]:
    """`(Hugging Face name, array)` for each tensor of `model`, dequantised one at a time with
    the `gguf` package into float32, llama.cpp's query / key row order undone, then cast to
    `dtype`."""
    by_name = {t.name: t for t in _reader(model.path).tensors}
    for tensor in model.tensors.values():
        yield tensor.hf_name, _dequantised(by_name[tensor.gguf_name], tensor, dtype)


class _DequantisedTensors:
    """A GGUF model's tensors as `load_tensors` reads them: Hugging Face names and layouts,
    dequantised into float32 a whole tensor at a time (the last one kept for its other
    shards)."""

    def __init__(self, model: GGUFModel):
        self.directory = model.path
        self.model = model
        self.file_of = {name: model.path for name in model.tensors}
        self._raw = {t.name: t for t in _reader(model.path).tensors}
        self._last: tuple[str, np.ndarray] | None = None

    def names(self) -> set[str]:
        return set(self.model.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.model.tensors[name].shape

    def dtype_code(self, name: str) -> str:
        return "F32"  # dequantised

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        if self._last is None or self._last[0] != name:
            tensor = self.model.tensors[name]
            self._last = name, _dequantised(self._raw[tensor.gguf_name], tensor, np.float32)
        return self._last[1][index]


def load_gguf(
    path: str | os.PathLike, options: LoadOptions | None = None, **keywords: Any
) -> HFCheckpoint:
    """Load a GGUF model file (Llama, Qwen2 or Qwen3; see `read_gguf`) into the decoder.

    As `load_hf_checkpoint` loads a Hugging Face checkpoint, with the same arguments: the
    config from the metadata, every tensor accounted for before any is read (a missing or
    unexpected one is an error naming it), and each parameter created with its sharding,
    its shards cut from the tensor dequantised with the `gguf` package (one tensor on the
    host at a time). The tokenizer is `gguf_tokenizer(path)`.

    Args:
      path: the `.gguf` file.
      options: how to load it (`LoadOptions`, as for `load_hf_checkpoint`); None means its
        defaults.
      **keywords: fields of `LoadOptions` by name, replacing those of `options`.

    Returns:
      An `HFCheckpoint` whose `hf_config` is the equivalent `config.json`.

    Raises:
      FileNotFoundError: the file does not exist.
      ValueError: as `read_gguf`, and naming the tensor for one missing from the file.
      TypeError: for a keyword argument that is not a field of `LoadOptions`.

    Examples:
      >>> import tempfile
      >>> import numpy as np
      >>> from flax import nnx
      >>> from tunelib.formats import load_gguf, save_gguf
      >>> from tunelib.models import Decoder, DecoderConfig
      >>> config = DecoderConfig(vocab_size=64, hidden_size=64, intermediate_size=96,
      ...                        num_hidden_layers=2, num_attention_heads=4,
      ...                        num_key_value_heads=2, tie_word_embeddings=True)
      >>> graphdef, params = nnx.split(Decoder(config, rngs=nnx.Rngs(0)))
      >>> path = save_gguf(tempfile.mkdtemp() + "/tiny.gguf", graphdef, params,
      ...                  model_type="llama", dtype="F32")
      >>> loaded = load_gguf(path)
      >>> kernel = loaded.params["layers"][1]["self_attn"]["q_proj"]["kernel"]
      >>> bool(np.array_equal(kernel, params["layers"][1]["self_attn"]["q_proj"]["kernel"][...]))
      True
    """
    options = LoadOptions.from_arguments(options, **keywords)
    model = read_gguf(path)
    return load_tensors(_DequantisedTensors(model), model.hf_config, options)


def convert_gguf(
    path: str | os.PathLike,
    directory: str | os.PathLike,
    *,
    dtype: str = "float32",
    max_shard_size: int = 5 * 10**9,
    overwrite: bool = False,
) -> Path:
    """Write a GGUF model file as a Hugging Face checkpoint folder: `config.json`, the
    dequantised weights in safetensors files, and the tokenizer (`tokenizer.json`,
    `tokenizer_config.json` and the chat template, from `gguf_tokenizer`) when
    the file has one.

    The folder then loads with `load_hf_checkpoint`, with `transformers`, and
    as any recipe's `--model`. It is written as `save_hf_checkpoint` writes one: one shard's
    tensors on the host at a time, into a temporary folder that takes `directory`'s place only
    once complete. An existing, non-empty `directory` is an error unless `overwrite`.

    Args:
      path: the `.gguf` file (see `read_gguf`).
      directory: the folder to write.
      dtype: the weights' dtype in the folder: float32, bfloat16 or float16.
      max_shard_size: the most bytes of tensor data a safetensors file holds.
      overwrite: replace an existing folder.

    Returns:
      The folder.
    """
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}.")
    directory = Path(directory)
    if directory.exists() and any(directory.iterdir()) and not overwrite:
        raise FileExistsError(f"{directory} exists and is not empty; pass overwrite=True.")
    model = read_gguf(path)
    target = np.dtype(dtype)
    by_name = {t.name: t for t in _reader(model.path).tensors}
    tensors = [
        TensorToWrite(
            t.hf_name, t.shape, target,
            lambda t=t: _dequantised(by_name[t.gguf_name], t, target),
        )
        for t in model.tensors.values()
    ]  # fmt: skip
    config = {**model.hf_config, "torch_dtype": dtype}
    has_tokenizer = "tokenizer.ggml.model" in model.metadata
    return write_checkpoint(
        directory, tensors, config, max_shard_size=max_shard_size,
        tokenizer=gguf_tokenizer(path) if has_tokenizer else None,
    )  # fmt: skip


def gguf_raw_tensors(
    model: GGUFModel,
) -> Iterator[tuple[GGUFTensor, np.ndarray, np.ndarray | None]]:
    """`(tensor, data, rows)` for each tensor of `model`, still as the file stores it.

    `data` is the tensor as the `gguf` package's reader maps it from the file, without a
    copy: for a block type (Q8_0, Q4_K, ...) uint8 `[rows, bytes per row]`, each row of the
    Hugging Face shape `tensor.shape` a run of whole blocks; F32 and F16 tensors as such
    arrays. `rows` is None, or, for Llama's query and key weights, the order that undoes
    llama.cpp's interleaving of each head's two rotary halves: row `i` of the Hugging Face
    weight is row `rows[i]` of the file (`data[rows]`), so a quantised tensor is put back in
    order by moving whole rows of blocks. `gguf_tensors` gives the same tensors dequantised.

    Examples:
      >>> import tempfile, gguf, numpy as np
      >>> from tunelib.formats import gguf_raw_tensors, read_gguf
      >>> path = tempfile.mkdtemp() + "/tiny.gguf"
      >>> w = gguf.GGUFWriter(path, "llama")
      >>> for key, value in {"block_count": 1, "embedding_length": 32,
      ...                    "feed_forward_length": 64, "attention.head_count": 2,
      ...                    "vocab_size": 10}.items():
      ...     w.add_uint32(f"llama.{key}", value)
      >>> q8 = gguf.GGMLQuantizationType.Q8_0
      >>> embedding = gguf.quants.quantize(np.ones((10, 32), np.float32), q8)
      >>> w.add_tensor("token_embd.weight", embedding, raw_dtype=q8)
      >>> w.add_tensor("blk.0.attn_q.weight", np.eye(32, dtype=np.float32))
      >>> w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file()
      >>> w.close()
      >>> for tensor, data, rows in gguf_raw_tensors(read_gguf(path)):
      ...     print(tensor.hf_name, tensor.type_name, data.dtype, data.shape)
      ...     print("  rows:", None if rows is None else rows[:10])
      model.embed_tokens.weight Q8_0 uint8 (10, 34)
        rows: None
      model.layers.0.self_attn.q_proj.weight F32 float32 (32, 32)
        rows: [ 0  2  4  6  8 10 12 14  1  3]
    """
    by_name = {t.name: t for t in _reader(model.path).tensors}
    for tensor in model.tensors.values():
        rows = None
        if tensor.unpermute_heads is not None:
            rows = _unpermute(np.arange(tensor.shape[0]), tensor.unpermute_heads)
        yield tensor, by_name[tensor.gguf_name].data, rows
