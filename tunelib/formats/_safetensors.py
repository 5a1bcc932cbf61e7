"""Tensors of a safetensors checkpoint (one file or sharded with an index), read and written.

Reading goes through `safetensors.safe_open(..., framework="numpy")` and `get_slice`, so only
the requested part of a tensor is read. NumPy knows bfloat16 once `ml_dtypes` is imported,
which is what lets the NumPy framework read bf16 checkpoints.
"""

import contextlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype codes of floating-point tensors, as NumPy dtypes.
FLOAT_DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}


@runtime_checkable
class TensorSource(Protocol):
    """Named tensors in Hugging Face's names and layouts, read a slice at a time:
    `TensorFiles` (safetensors) or a GGUF file's dequantised tensors."""

    directory: Path  # the folder or file, for messages
    file_of: dict[str, Any]  # the file of each tensor, for messages

    def names(self) -> set[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype_code(self, name: str) -> str: ...

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray: ...


class TensorFiles(contextlib.AbstractContextManager):
    """The tensors of a checkpoint directory, by name, across all its safetensors files.

    The directory holds `model.safetensors.index.json` (its `weight_map` names the file of
    every tensor) and the files it names, or else a single `model.safetensors`. Use as a
    context manager; the files stay open until it exits.
    """

    def __init__(self, directory: Path):
        self._stack = contextlib.ExitStack()
        self.directory = directory
        index_path = directory / INDEX_FILE
        if index_path.exists():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise ValueError(f"{index_path} is not a valid index file: {error!r}.") from None
            files = sorted(set(weight_map.values()))
        elif (directory / SINGLE_FILE).exists():
            weight_map, files = None, [SINGLE_FILE]
        else:
            raise FileNotFoundError(
                f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE} (only safetensors "
                "checkpoints are read, not pytorch_model.bin)."
            )
        self.file_of: dict[str, str] = {}
        self._handles: dict[str, Any] = {}
        for name in files:
            path = directory / name
            if not path.exists():
                raise FileNotFoundError(f"{INDEX_FILE} names {name}, which is not in {directory}.")
            try:
                handle = self._stack.enter_context(safe_open(str(path), framework="numpy"))
            except SafetensorError as error:  # a header that does not parse, a file cut short
                raise ValueError(
                    f"{path} is not a readable safetensors file ({error}): it is damaged or "
                    "cut short."
                ) from None
            self._handles[name] = handle
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
                if key in self.file_of:
                    raise ValueError(f"tensor {key!r} is in both {self.file_of[key]} and {name}.")
                self.file_of[key] = name
        if weight_map is not None:
            wrong = {k: f for k, f in weight_map.items() if self.file_of.get(k) != f}
            if wrong:
                key = sorted(wrong)[0]
                raise ValueError(
                    f"{INDEX_FILE} puts tensor {key!r} in {wrong[key]}, but that file does not "
                    f"hold it ({len(wrong)} such entries)."
                )

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def names(self) -> set[str]:
        return set(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype_code(self, name: str) -> str:
        return self._slice(name).get_dtype()

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        """`tensor[index]` of tensor `name`, reading only that part of its file."""
        return np.asarray(self._slice(name)[index])

    def _slice(self, name: str) -> Any:
        return self._handles[self.file_of[name]].get_slice(name)


class TensorToWrite(NamedTuple):
    """One tensor of a checkpoint being written; `fetch` makes its host array on demand."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    fetch: Callable[[], np.ndarray]


def shard_plan(tensors: Sequence[TensorToWrite], max_shard_size: int) -> list[list[TensorToWrite]]:
    """Consecutive groups of `tensors` of at most `max_shard_size` bytes each.

    A tensor larger than the limit gets a shard of its own (tensors are never split), as in
    `transformers`' `save_pretrained`.
    """
    shards: list[list[TensorToWrite]] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = tensor_bytes(tensor)
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += nbytes
    return shards


def tensor_bytes(tensor: TensorToWrite) -> int:
    return int(np.prod(tensor.shape, dtype=np.int64)) * tensor.dtype.itemsize


def write_tensors(
    directory: Path, tensors: Sequence[TensorToWrite], *, max_shard_size: int
) -> list[str]:
    """Write `tensors` into `directory` as Hugging Face names them; returns the files written.

    One shard is `model.safetensors`; more are `model-00001-of-0000N.safetensors` with a
    `model.safetensors.index.json` holding `metadata.total_size` (bytes of tensor data) and
    the `weight_map` from tensor name to file. Only one shard's tensors are on the host at a
    time.
    """
    shards = shard_plan(tensors, max_shard_size)
    if len(shards) == 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards, strict=True):
        # `np.asarray(order="C")`, not `np.ascontiguousarray`, which makes a scalar `[1]`.
        arrays = {tensor.name: np.asarray(tensor.fetch(), order="C") for tensor in shard}
        save_file(arrays, str(directory / name), metadata={"format": "pt"})
        del arrays
    if len(shards) > 1:
        index = {
            "metadata": {"total_size": sum(tensor_bytes(t) for t in tensors)},
            "weight_map": {
                t.name: name for name, shard in zip(names, shards, strict=True) for t in shard
            },
        }
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        names.append(INDEX_FILE)
    return names
