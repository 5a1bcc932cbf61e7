"""Reading a GGUF file: its metadata and its tensors' headers with `struct` over a memory
map, and each tensor's data as a NumPy view of the file.

`gguf.GGUFReader` builds a NumPy view for every part of every field, which for a vocabulary
is hundreds of thousands of views: 2.5 s for SmolLM2-135M's file on 2 CPU cores, against
0.03 s here for the same metadata, tensors and views of their data (equal to the reader's,
`tests/formats/test_gguf_file.py`). Versions 2 and 3, either byte order.
"""

import dataclasses
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

from tunelib.formats._gguf_layout import MAGIC, check_gguf_file

# The alignment of the tensors' data when the file does not say (`general.alignment`).
DEFAULT_ALIGNMENT = 32


def read_metadata(path: Path) -> dict[str, Any]:
    """Every key-value field of a GGUF file (version 2 or 3), arrays as lists.

    Only the header and metadata are read (the tokenizer's needs).

    Raises:
      FileNotFoundError: when there is no such file.
      ValueError: naming the file, when it is not GGUF or ends inside its metadata.
    """
    import gguf

    check_gguf_file(path)
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            return _Fields(data, path, gguf.GGUFValueType).read()
        except (struct.error, _Truncated):
            raise ValueError(
                f"{path} is not a readable GGUF file: it ends inside its metadata "
                f"(after {len(data)} bytes); is it truncated?"
            ) from None


class _Truncated(Exception):
    pass


class _Fields:
    """A reader of the header and key-value fields of a GGUF file held in `data`."""

    def __init__(self, data: mmap.mmap, path: Path, types: Any):
        self.data, self.path, self.types = data, path, types
        self.offset = len(MAGIC)
        self.scalars = {
            types.UINT8: "B",
            types.INT8: "b",
            types.UINT16: "H",
            types.INT16: "h",
            types.UINT32: "I",
            types.INT32: "i",
            types.FLOAT32: "f",
            types.BOOL: "?",
            types.UINT64: "Q",
            types.INT64: "q",
            types.FLOAT64: "d",
        }
        # The version tells the byte order: a big-endian file's reads as a multiple of 2**16.
        (version,) = struct.unpack_from("<I", data, self.offset)
        self.order = "<" if version & 0xFFFF else ">"
        self.version = self.scalar("I")

    def read(self) -> dict[str, Any]:
        if self.version not in (2, 3):
            raise ValueError(
                f"{self.path} is not a readable GGUF file: its version is {self.version}, and "
                f"versions 2 and 3 are read."
            )
        self.num_tensors, num_fields = self.scalar("Q"), self.scalar("Q")
        fields = {}
        for _ in range(num_fields):
            key = self.string("a key")
            fields[key] = self.value(self.scalar("I"), key)
        return fields

    def tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        """The next tensor's header: its name, dimensions (GGUF's order), type and offset."""
        name = self.string("a tensor name")
        dims = tuple(self.scalar("Q") for _ in range(self.scalar("I")))
        return name, dims, self.scalar("I"), self.scalar("Q")

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(self.order + fmt, self.data, self.offset)
        self.offset += struct.calcsize(fmt)
        return value

    def string(self, key: str) -> str:
        size = self.scalar("Q")
        raw = self.data[self.offset : self.offset + size]
        if len(raw) < size:
            raise _Truncated
        self.offset += size
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ValueError(
                f"{self.path}: {key} holds text that is not UTF-8 ({error})."
            ) from None

    def strings(self, count: int, key: str) -> list[str]:
        """An array of `count` strings (a vocabulary: the one loop that needs to be quick)."""
        data, offset, items = self.data, self.offset, []
        size_at = struct.Struct(self.order + "Q").unpack_from
        try:
            for _ in range(count):
                (size,) = size_at(data, offset)
                offset += 8
                items.append(data[offset : offset + size].decode("utf-8"))
                offset += size
        except UnicodeDecodeError as error:
            if offset + size > len(data):
                raise _Truncated from None
            raise ValueError(
                f"{self.path}: {key} holds text that is not UTF-8 ({error})."
            ) from None
        if offset > len(data):
            raise _Truncated
        self.offset = offset
        return items

    def value(self, value_type: int, key: str) -> Any:
        if value_type in self.scalars:
            return self.scalar(self.scalars[value_type])
        if value_type == self.types.STRING:
            return self.string(key)
        if value_type == self.types.ARRAY:
            item_type, count = self.scalar("I"), self.scalar("Q")
            if item_type in self.scalars:
                dtype = np.dtype(self.order + self.scalars[item_type])
                if self.offset + count * dtype.itemsize > len(self.data):
                    raise _Truncated
                items = np.frombuffer(self.data, dtype, count, self.offset).tolist()
                self.offset += count * dtype.itemsize
                return items
            if item_type == self.types.STRING:
                return self.strings(count, key)
            return [self.value(item_type, key) for _ in range(count)]
        raise ValueError(f"{self.path}: {key} has value type {value_type}, which GGUF lacks.")


@dataclasses.dataclass(frozen=True)
class GGUFFileTensor:
    """One tensor of a GGUF file, as `gguf.GGUFReader` gives it: its name, its
    `gguf.GGMLQuantizationType`, its dimensions in GGUF's order (innermost first) and its data,
    a read-only view of the file (typed for float and integer types, bytes for quantised
    blocks, shaped as the reader shapes it)."""

    name: str
    tensor_type: Any
    shape: np.ndarray
    data: np.ndarray


@dataclasses.dataclass(frozen=True)
class GGUFFile:
    """A GGUF file read: `metadata` (every key-value field, arrays as lists, with the
    reader's `GGUF.version`, `GGUF.tensor_count` and `GGUF.kv_count`) and `tensors` in file
    order."""

    path: Path
    metadata: dict[str, Any]
    tensors: list[GGUFFileTensor]


def read_gguf_file(path: Path) -> GGUFFile:
    """The metadata and tensors of the GGUF file `path`.

    Raises:
      FileNotFoundError: when there is no such file.
      ValueError: naming the file, when it is not GGUF, ends inside its headers or its
        tensors' data, or holds a tensor type or alignment GGUF does not define.
    """
    import gguf

    check_gguf_file(path)
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
        try:
            fields = _Fields(data, path, gguf.GGUFValueType)
            metadata = fields.read()
            infos = [fields.tensor_info() for _ in range(fields.num_tensors)]
        except (struct.error, _Truncated):
            raise ValueError(
                f"{path} is not a readable GGUF file: it ends inside its headers (after "
                f"{len(data)} bytes); is it truncated?"
            ) from None
        offset, order = fields.offset, fields.order
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: general.alignment {alignment!r} is not a power of two.")
    start = -(-offset // alignment) * alignment
    mapped = np.memmap(path, mode="r")
    tensors = [_tensor(path, mapped, start, order, *info) for info in infos]
    head = {
        "GGUF.version": fields.version,
        "GGUF.tensor_count": fields.num_tensors,
        "GGUF.kv_count": len(metadata),
    }
    return GGUFFile(path, {**head, **metadata}, tensors)


# The element type of each unquantised tensor type's data; quantised blocks are bytes.
_PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip


def _tensor(path, mapped, start, order, name, dims, raw_type, offset) -> GGUFFileTensor:
    import gguf

    try:
        tensor_type = gguf.GGMLQuantizationType(raw_type)
    except ValueError:
        raise ValueError(f"{path}: tensor {name!r} has type {raw_type}, unknown to GGUF.") from None
    shape = tuple(reversed(dims))
    count = int(np.prod(dims, dtype=np.int64))
    block, size = gguf.GGML_QUANT_SIZES[tensor_type]
    if tensor_type.name in _PLAIN:
        dtype = np.dtype(_PLAIN[tensor_type.name]).newbyteorder(order)
    else:
        dtype, count = np.dtype(np.uint8), count * size // block
        shape = gguf.quant_shape_to_byte_shape(shape, tensor_type)
    at = start + offset
    if at + count * dtype.itemsize > len(mapped):
        raise ValueError(
            f"{path} is not a readable GGUF file: tensor {name!r} ends after the file's "
            f"{len(mapped)} bytes; is it truncated?"
        )
    data = np.ndarray(count, dtype, mapped, at).reshape(shape)
    return GGUFFileTensor(name, tensor_type, np.array(dims, np.uint64), data)
